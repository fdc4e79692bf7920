"""DPO on 2 ranks (torchrun, gloo on CPU, FSDP2) gives the 1-rank run: same losses, metrics and weights."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.train.conftest import ROOT, env, final_weights
from tests.train.test_sft_equivalence import assert_same_trajectory
from tests.train_preference.conftest import dpo_overrides, read_jsonl, run_cli


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["precomputed", "live"])
def test_two_ranks_equal_one_rank(pref_model_dir, pref_data, tmp_path, reference):
    common = {"train.max_steps": 3, "train.max_grad_norm": "null", "data.shuffle": "false",
              "dpo.reference": reference, "dpo.reference_cache_dir": str(tmp_path / "cache"),
              "train.global_batch_size": 8}
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli("dpo", dpo_overrides(pref_model_dir, pref_data, one, **common, **{"train.batch_size": 8})) == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "posttrain", "dpo", *dpo_overrides(pref_model_dir, pref_data, two, **common, **{"train.batch_size": 4})]
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_trajectory(one, two)
    steps = {run: [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m] for run in (one, two)}
    for a, b in zip(steps[one], steps[two], strict=True):
        for key in ("rewards/accuracy", "rewards/margin", "kl_to_ref"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    evals = {run: [m for m in read_jsonl(run / "metrics.jsonl") if "eval_phase" in m] for run in (one, two)}
    assert evals[one][-1]["eval/loss"] == pytest.approx(evals[two][-1]["eval/loss"], rel=1e-5)
    assert evals[two][-1]["eval/pairs"] == 64
    assert final_weights(two).keys() == final_weights(one).keys()
