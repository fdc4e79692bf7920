"""GRPO as a process: SIGKILL then resume gives the same final model bit for bit (prompt sampler state and
rollout seeds are checkpointed), SIGTERM saves and exits 75, and 2 ranks train like 1."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.rl.conftest import grpo_overrides, killed_and_resumed
from tests.train.conftest import ROOT, env, final_weights, read_jsonl, sigterm_after

RESUME = {"train.max_steps": 6, "train.save_every": 2, "rl.pass_rate_low": 0.0, "rl.pass_rate_high": 0.99,
          "rl.pass_rate_min_tries": 4}


def grpo_command(overrides: list[str], nproc: int = 1, config: str = "grpo_tiny") -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "posttrain", "grpo", "--config", config, *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "posttrain", "grpo", "--config", config, *overrides]


def run(overrides: list[str], nproc: int = 1, config: str = "grpo_tiny") -> subprocess.CompletedProcess:
    return subprocess.run(grpo_command(overrides, nproc, config), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=600)


def test_sigkill_then_resume_is_bit_identical(tiny_model_dir, rl_data, tmp_path):
    clean = tmp_path / "clean"
    done = run(grpo_overrides(tiny_model_dir, rl_data, clean, **RESUME))
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "killed"
    overrides = grpo_overrides(tiny_model_dir, rl_data, out, **RESUME)
    killed_and_resumed(run, overrides, out, crash_at=3)
    expected, got = final_weights(clean), final_weights(out)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    rewards = [[r["reward_mean"] for r in read_jsonl(d / "metrics.jsonl") if "loss" in r] for d in (clean, out)]
    assert rewards[0] == rewards[1]  # the resumed run sampled the same completions at steps 4 and 5


def test_sigterm_saves_and_exits_resumable(tiny_model_dir, rl_data, tmp_path):
    out = tmp_path / "run"
    overrides = grpo_overrides(tiny_model_dir, rl_data, out, **{"train.max_steps": 400})
    code, err = sigterm_after(grpo_command(overrides), out, records=2)
    assert code == 75, err[-2000:]
    preempted = [a for a in read_jsonl(out / "alerts.jsonl") if a["kind"] == "preempted"]
    step = preempted[0]["step"]
    assert (out / "checkpoints" / f"step-{step:06d}" / "manifest.json").exists() and not (out / "final").exists()


@pytest.mark.slow
def test_two_ranks_train_like_one(tiny_model_dir, rl_data, tmp_path):
    weights, rewards = {}, {}
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}"
        done = run(grpo_overrides(tiny_model_dir, rl_data, out, **{"train.max_steps": 3, "train.batch_size": 4}),
                   nproc=nproc)
        assert done.returncode == 0, done.stderr[-3000:]
        weights[nproc] = final_weights(out)
        rewards[nproc] = [r["reward_mean"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert rewards[2] == rewards[1]  # each prompt's samples do not depend on which rank drew them
    # Sharded all-reduce sums in another order; Adam turns that noise into at most ~10% of one lr step.
    for name, tensor in weights[1].items():
        torch.testing.assert_close(weights[2][name], tensor, atol=1e-4, rtol=1e-3)
