"""Verifier settings travel with each call: concurrent callers (threaded reward workers, a web service, two
evaluations) each run code under their own sandbox limits and their own unsandboxed-code permission."""

from __future__ import annotations

import threading

import pytest

from posttrain.eval import sandbox
from posttrain.eval.items import EvalItem
from posttrain.eval.sandbox import SandboxLimits, SandboxUnavailable, sandbox_support
from posttrain.eval.verifiers import VerifySettings, verify

SUPPORTED, _ = sandbox_support()
# Sleeps, then passes its test: it times out only where the wall-clock limit is shorter than the sleep.
SLOW_BUT_RIGHT = EvalItem(id="slow", prompt="write f", verifier="code", tests="assert f() == 1",
                          group="code")
OUTPUT = "```python\nimport time\ndef f():\n    time.sleep(2.0)\n    return 1\n```"


def _verify_together(calls: dict[str, VerifySettings]) -> dict[str, object]:
    """Run verify for each named settings in its own thread, all released at once; result or exception."""
    barrier = threading.Barrier(len(calls))
    results: dict[str, object] = {}

    def work(name: str, settings: VerifySettings) -> None:
        barrier.wait()
        try:
            results[name] = verify(SLOW_BUT_RIGHT, OUTPUT, settings)
        except Exception as exc:  # noqa: BLE001 - the test inspects which thread raised what
            results[name] = exc

    threads = [threading.Thread(target=work, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return results


def test_two_threads_verify_code_under_their_own_limits():
    # Where the sandbox cannot isolate code, both may run unsandboxed: the limits still apply.
    allow = not SUPPORTED
    tiny = SandboxLimits(timeout_s=0.5, cpu_s=1, memory_mb=512, max_processes=16)
    generous = SandboxLimits(timeout_s=120.0, cpu_s=60, memory_mb=512, max_processes=16)
    results = _verify_together({
        "tiny": VerifySettings(code_limits=tiny, allow_unsandboxed_code=allow),
        "generous": VerifySettings(code_limits=generous, allow_unsandboxed_code=allow),
    })
    assert not results["tiny"].passed and "timed out" in results["tiny"].detail, results["tiny"]
    assert "after 0.5s" in results["tiny"].detail
    assert results["generous"].passed, results["generous"]
    assert tiny.timeout_s == 0.5 and generous.timeout_s == 120.0  # the callers' limits are not modified


def test_unsandboxed_permission_is_per_call(monkeypatch):
    monkeypatch.setattr(sandbox, "sandbox_support", lambda: (False, "no namespaces in this test"))
    limits = SandboxLimits(timeout_s=60.0, cpu_s=30, memory_mb=512, max_processes=16)
    results = _verify_together({
        "refused": VerifySettings(code_limits=limits, allow_unsandboxed_code=False),
        "allowed": VerifySettings(code_limits=limits, allow_unsandboxed_code=True),
    })
    assert isinstance(results["refused"], SandboxUnavailable), results["refused"]
    assert results["allowed"].passed and "UNSANDBOXED" in results["allowed"].detail, results["allowed"]


def test_item_options_override_the_callers_limits():
    item = SLOW_BUT_RIGHT.model_copy(update={"options": {"timeout_s": 0.5}})
    settings = VerifySettings(code_limits=SandboxLimits(timeout_s=120.0, cpu_s=60, memory_mb=512, max_processes=16),
                              allow_unsandboxed_code=not SUPPORTED)
    result = verify(item, OUTPUT, settings)
    assert not result.passed and "after 0.5s" in result.detail
    assert settings.code_limits.timeout_s == 120.0


def test_default_settings_refuse_unsandboxed_code(monkeypatch):
    monkeypatch.setattr(sandbox, "sandbox_support", lambda: (False, "no namespaces in this test"))
    with pytest.raises(SandboxUnavailable):
        verify(SLOW_BUT_RIGHT, OUTPUT)
