"""The open loop: a source that makes its batches from the current weights resumes bit-exact after SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from safetensors.torch import load_file

from tests.train.conftest import ROOT, env, read_jsonl


def run_toy(model: str, out, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tests.train.toy_source", model, str(out), *extra]
    return subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def test_a_model_dependent_source_resumes_bit_exact_after_sigkill(tiny_model_dir, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run_toy(tiny_model_dir, whole).returncode == 0
    crashed = run_toy(tiny_model_dir, killed, "--crash-at", "4")
    assert crashed.returncode == -signal.SIGKILL
    assert not (killed / "final.safetensors").exists()
    resumed = run_toy(tiny_model_dir, killed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert any(a["kind"] == "resumed" and a["step"] == 4 for a in read_jsonl(killed / "alerts.jsonl"))

    a, b = load_file(str(whole / "final.safetensors")), load_file(str(killed / "final.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    drawn = json.loads((whole / "drawn.json").read_text())
    assert json.loads((killed / "drawn.json").read_text()) == drawn
    # The source's state steered the run: not the same two prompts every step.
    assert len({tuple(d) for d in drawn}) > 1
    # Step 4 ran twice in the killed run (before the kill and after the resume), on the same prompts.
    units = [u for u in read_jsonl(killed / "units.jsonl")]
    by_step: dict[int, list] = {}
    for u in units:
        by_step.setdefault(u["step"], []).append(u["ids"])
    assert all(len(set(map(tuple, ids))) == 1 for ids in by_step.values())
