"""Sandbox limits shared by the eval tests."""

from __future__ import annotations

from posttrain.eval.sandbox import SandboxLimits


def roomy_limits(cpu_s: int = 5, memory_mb: int = 512) -> SandboxLimits:
    """Limits for tests whose verdict is anything but a wall-clock timeout.

    The CPU limit bounds every hostile case (a spinning process stops at ``cpu_s`` CPU-seconds); the wall clock is
    only a backstop, and a generous one, because on a loaded 2-core CI box a 0.3 s memory hog once took over 3 s of
    wall time and was scored "timeout" instead of "memory". Tests of the timeout itself set their own limits."""
    return SandboxLimits(timeout_s=60.0, cpu_s=cpu_s, memory_mb=memory_mb, max_processes=16)
