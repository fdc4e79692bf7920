"""posttrain.threads: explicit setting > OMP_NUM_THREADS > every usable core, with PASSIVE waiting, applied
before torch loads.

Each case that imports torch runs in a fresh interpreter: OpenMP settings are read once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from posttrain.threads import ThreadChoice, choose_threads, configure_threads, usable_cores


def test_choice_order(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert choose_threads() == ThreadChoice(len(os.sched_getaffinity(0)), "all cores") == choose_threads(None)
    assert usable_cores() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads() == ThreadChoice(3, "OMP_NUM_THREADS")
    assert choose_threads(5) == ThreadChoice(5, "requested")
    monkeypatch.setenv("OMP_NUM_THREADS", "garbage")  # not a count: ignored, not a crash
    assert choose_threads().reason == "all cores"


def test_rejects_a_nonpositive_request():
    with pytest.raises(ValueError, match=">= 1"):
        configure_threads(0)


PROBE = """
import json, os, sys
from posttrain.threads import configure_threads
requested = json.loads(sys.argv[1])
before = "torch" in sys.modules
if sys.argv[2] == "torch-first":
    import torch
choice = configure_threads(requested)
import torch
print(json.dumps({"threads": choice.threads, "reason": choice.reason, "torch": torch.get_num_threads(),
                  "env": os.environ.get("OMP_NUM_THREADS"), "wait": os.environ.get("OMP_WAIT_POLICY"),
                  "torch_before": before}))
"""


def _probe(requested, env_changes: dict[str, str | None], order: str = "helper-first") -> dict:
    env = dict(os.environ)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(requested), order], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_default_is_applied_to_torch_and_to_the_environment():
    got = _probe(None, {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None})
    assert got["reason"] == "all cores" and got["threads"] == len(os.sched_getaffinity(0))
    assert not got["torch_before"] and got["torch"] == got["threads"] and got["env"] == str(got["threads"])
    assert got["wait"] == "PASSIVE"


def test_omp_num_threads_is_honoured_and_an_explicit_request_wins():
    got = _probe(None, {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"})
    assert (got["threads"], got["reason"], got["torch"], got["wait"]) == (1, "OMP_NUM_THREADS", 1, "ACTIVE")
    got = _probe(2, {"OMP_NUM_THREADS": "1"})
    assert (got["threads"], got["reason"], got["torch"], got["env"]) == (2, "requested", 2, "2")


def test_torch_already_imported_still_gets_the_thread_count():
    got = _probe(1, {"OMP_NUM_THREADS": None}, order="torch-first")
    assert (got["threads"], got["torch"]) == (1, 1)


def test_the_cli_configures_threads_before_running_a_command(tmp_path):
    probe = ("import json, os; from posttrain.cli import main; main(['recipes', 'list']); "
             "print(json.dumps([os.environ.get('OMP_NUM_THREADS'), os.environ.get('OMP_WAIT_POLICY')]))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    threads, wait = json.loads(proc.stdout.strip().splitlines()[-1])
    assert threads is not None and int(threads) >= 1 and wait == "PASSIVE"


def test_small_steps_run_on_one_thread_only_when_threads_sleep(monkeypatch):
    import torch

    from posttrain.threads import SMALL_STEP_FLOPS, one_thread_for_small_steps

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        with one_thread_for_small_steps(SMALL_STEP_FLOPS / 4) as inside:
            assert inside == torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2  # restored
        with one_thread_for_small_steps(SMALL_STEP_FLOPS * 4) as inside:
            assert inside == torch.get_num_threads() == 2  # enough work per step to share
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        with one_thread_for_small_steps(SMALL_STEP_FLOPS / 4) as inside:
            assert inside == 2  # spinning threads wake for free: keep them
    finally:
        torch.set_num_threads(before)
