"""A DPO run killed mid-way and rerun resumes from its checkpoint (policy, optimizer, data position and
BCO's running δ) and ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.train.conftest import ROOT, env, final_weights
from tests.train.test_sft_equivalence import max_diff
from tests.train_preference.conftest import dpo_overrides, read_jsonl, run_cli


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_result(pref_model_dir, pref_data, tmp_path):
    common = {"dpo.loss": "bco_pair", "train.max_steps": 4, "train.save_every": 2,
              "dpo.reference_cache_dir": str(tmp_path / "cache"), "data.eval": ""}
    data = {"train": pref_data["train"]}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run_cli("dpo", dpo_overrides(pref_model_dir, data, whole, **common)) == 0

    command = [sys.executable, "-m", "posttrain", "dpo", *dpo_overrides(pref_model_dir, data, resumed, **common)]
    killed = subprocess.run([*command, "debug.crash_at_step=2"], cwd=ROOT, env=env(), capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL after step 2's update
    assert not (resumed / "final").exists()
    again = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]

    alerts = read_jsonl(resumed / "alerts.jsonl")
    assert any(a["kind"] == "resumed" and a["step"] == 2 for a in alerts)
    steps_whole = {m["step"]: m for m in read_jsonl(whole / "metrics.jsonl") if "loss" in m}
    steps_resumed = {m["step"]: m for m in read_jsonl(resumed / "metrics.jsonl") if "loss" in m}
    for step in (2, 3):  # run again after the resume, from the restored state
        assert steps_resumed[step]["loss"] == pytest.approx(steps_whole[step]["loss"], rel=1e-6)
    assert max_diff(final_weights(whole), final_weights(resumed)) < 1e-6
    state = {run: json.loads((run / "checkpoints" / "step-000004" / "trainer.json").read_text())["source"]
             for run in (whole, resumed)}
    assert state[resumed]["bco_count"] == state[whole]["bco_count"] == 4 * 2 * 8
    assert state[resumed]["bco_mean"] == pytest.approx(state[whole]["bco_mean"], rel=1e-6)
