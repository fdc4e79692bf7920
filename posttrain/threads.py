"""How many CPU threads torch uses, decided once per process before torch starts working.

torch's CPU kernels run on an OpenMP pool, one thread per core by default, and OpenMP threads
spin-wait between parallel regions. Two such jobs on the same cores (a second training run, a test
suite, another user on a shared box) each keep every core busy spinning, and both slow down by far more
than 2× (the quickstart took 24 minutes instead of 4 beside one other job). ``configure_threads`` picks:

1. ``requested`` when the caller has an explicit setting (a recipe's ``threads:`` key);
2. else ``OMP_NUM_THREADS`` when it is set (a user, torchrun, a test runner decided);
3. else the default policy, :func:`default_threads` (see there; measured in ``benchmarks/threads.py``,
   figures in ``benchmarks/README.md``).

It also sets ``OMP_WAIT_POLICY=PASSIVE`` unless that is set already: a waiting thread sleeps instead of
spinning, so an oversubscribed core is handed to whoever has work. OpenMP reads both variables once,
when torch loads it, so call this before the first ``import torch`` (the CLI does, for every command);
if torch is already imported, only ``torch.set_num_threads`` can still change, and it is called.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

# Below this many idle cores (cores minus the 1-minute load average) a job gets one thread: on a box
# where the other cores are taken, extra threads only add spinning and context switches.
MIN_IDLE_CORES_FOR_ALL = 1.0


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # requested | OMP_NUM_THREADS | idle | busy


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def load_average() -> float:
    """The 1-minute load average (runnable + waiting tasks), or 0 where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def default_threads(cores: int, load: float) -> ThreadChoice:
    """All cores when at least ``MIN_IDLE_CORES_FOR_ALL`` of them are idle, else one thread.

    The 1-minute load average lags: two jobs started in the same second both see an idle box and both
    take every core. PASSIVE waiting (set by :func:`configure_threads`) keeps that case from collapsing.
    """
    if cores - load >= MIN_IDLE_CORES_FOR_ALL:
        return ThreadChoice(cores, "idle")
    return ThreadChoice(1, "busy")


def _env_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def configure_threads(requested: int | None = None) -> ThreadChoice:
    """Decide the thread count (explicit > ``OMP_NUM_THREADS`` > default policy) and apply it; see the module docstring."""
    if requested is not None and requested < 1:
        raise ValueError(f"threads must be >= 1 (got {requested})")
    from_env = _env_threads()
    if requested is not None:
        choice = ThreadChoice(requested, "requested")
    elif from_env is not None:
        choice = ThreadChoice(from_env, "OMP_NUM_THREADS")
    else:
        choice = default_threads(usable_cores(), load_average())
    os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(choice.threads)
    return choice
