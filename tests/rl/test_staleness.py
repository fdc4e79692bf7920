"""Bounded staleness (``rl.max_staleness``) and the mismatch corrections as runs: SIGKILL then resume is
bit-identical with k = 1, the logged policy versions never lag by more than k (and by exactly k after
warm-up), the mismatch metrics reach metrics.jsonl, and k = 0 trains exactly as the synchronous loop."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.cli import main
from tests.rl.conftest import grpo_overrides, killed_and_resumed
from tests.rl.test_grpo_runs import run
from tests.train.conftest import final_weights, read_jsonl

MISMATCH_KEYS = ("rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max", "rollout/is_ratio_max",
                 "rollout/is_ratio_min")


def steps_of(out) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def assert_lag(steps: list[dict], k: int) -> None:
    """Every sample of step s came from the weights of step max(0, s − k): never older, and exactly that."""
    for record in steps:
        step = record["step"]
        assert record["rollout/staleness_max"] <= k, record
        assert record["rollout/version_min"] == record["rollout/version_max"] == max(0, step - k), record
        assert record["rollout/staleness_min"] == min(step, k)


def test_k1_sigkill_then_resume_is_bit_identical(tiny_model_dir, rl_data, tmp_path):
    settings = {"train.max_steps": 6, "train.save_every": 2, "rl.max_staleness": 1, "rl.is_correction": "tis",
                "rl.pass_rate_low": 0.0, "rl.pass_rate_high": 0.99, "rl.pass_rate_min_tries": 4}
    clean = tmp_path / "clean"
    done = run(grpo_overrides(tiny_model_dir, rl_data, clean, **settings))
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "killed"
    overrides = grpo_overrides(tiny_model_dir, rl_data, out, **settings)
    # killed after step 2: the checkpoint of step 2 holds step 2's rollouts (sampled at step 1), and the resumed
    # run redoes step 2 from them and samples step 3's from the restored weights
    def queued(out) -> None:
        state = json.loads((out / "checkpoints" / "step-000002" / "trainer.json").read_text())
        assert [(q["step"], q["version"]) for q in state["source"]["queue"]] == [(2, 1)]

    killed_and_resumed(run, overrides, out, crash_at=2, check=queued)
    expected, got = final_weights(clean), final_weights(out)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    logs = [steps_of(d) for d in (clean, out)]
    assert [r["reward_mean"] for r in logs[0]] == [r["reward_mean"] for r in logs[1]]
    for steps in logs:
        assert [r["step"] for r in steps] == list(range(6))
        assert_lag(steps, 1)
        for record in steps:
            assert all(key in record for key in (*MISMATCH_KEYS, "is_weight", "is_truncated_share")), record
            # Same model, two code paths (sampler and trainer): float noise, although the weights moved
            assert record["rollout/logprob_abs_diff_max"] < 1e-4 and record["rollout/is_ratio_max"] < 1.0001
        # Stale samples are trained: after warm-up the ratio to the sampling weights is no longer 1
        assert abs(steps[0]["log_ratio"]) < 1e-4 and max(abs(r["log_ratio"]) for r in steps[1:]) > 1e-4


def test_k2_lags_by_two_after_warm_up_through_a_skipped_update(tiny_model_dir, rl_data, tmp_path):
    out = tmp_path / "run"
    assert main(["grpo", "--config", "grpo_tiny", *grpo_overrides(tiny_model_dir, rl_data, out, **{
        "train.max_steps": 5, "rl.max_staleness": 2, "rl.is_correction": "mis", "rl.is_level": "sequence",
        "debug.spike_steps": "[1]"})]) == 0
    steps = steps_of(out)
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4]
    assert [r["rollout/staleness_max"] for r in steps] == [0, 1, 2, 2, 2]
    assert steps[1]["skipped"] and not steps[2]["skipped"]  # a rejected update does not disturb the queue
    assert_lag(steps, 2)
    assert all(r["is_masked_share"] == 0.0 and abs(r["is_weight"] - 1) < 1e-3 for r in steps)  # HF: no mismatch


def test_k0_is_the_synchronous_loop(tiny_model_dir, rl_data, tmp_path):
    """Every step samples from the weights it trains (first-update ratio 1), and the mismatch measurement
    (a forward without gradient at sampling time) does not change what is trained, bit for bit."""
    weights = {}
    for measure in ("true", "false"):
        out = tmp_path / measure
        assert main(["grpo", "--config", "grpo_tiny", *grpo_overrides(tiny_model_dir, rl_data, out, **{
            "train.max_steps": 3, "rl.measure_mismatch": measure})]) == 0
        weights[measure] = final_weights(out)
        steps = steps_of(out)
        assert_lag(steps, 0)
        assert all(abs(r["log_ratio"]) < 1e-4 and r["clip_fraction"] == 0.0 for r in steps)
        assert all((key in r) == (measure == "true") for r in steps for key in MISMATCH_KEYS)
    assert all(torch.equal(weights["true"][name], weights["false"][name]) for name in weights["true"])


def test_k1_rolls_back_and_skips_with_its_queue(tiny_model_dir, rl_data, tmp_path):
    """Two bad steps (2, 3) roll back to the checkpoint of step 2, whose queue holds step 2's rollouts; the
    skipped steps drop theirs, and sampling resumes from the restored weights: one warm-up, then the lag."""
    out = tmp_path / "run"
    assert main(["grpo", "--config", "grpo_tiny", *grpo_overrides(tiny_model_dir, rl_data, out, **{
        "train.max_steps": 7, "train.save_every": 2, "rl.max_staleness": 1, "health.max_consecutive": 2,
        "debug.nan_steps": "[2, 3]"})]) == 0
    rollbacks = [a for a in read_jsonl(out / "alerts.jsonl") if a["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 2 and rollbacks[0]["skipped_batches"] == [2, 3]
    steps = steps_of(out)
    assert [(r["step"], r["skipped"]) for r in steps] == [(0, False), (1, False), (2, True), (3, True), (4, False),
                                                          (5, False), (6, False)]  # the bad steps' records stay
    assert [(r["rollout/version_min"], r["rollout/staleness_max"]) for r in steps] == [
        (0, 0), (0, 1), (1, 1), (2, 1), (4, 0), (4, 1), (5, 1)]
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_k1_on_two_ranks_trains_like_one(tiny_model_dir, rl_data, tmp_path):
    """Each rank recomputes the trainer's log-probs of its own rollouts (a collective weight gather under
    FSDP2) and every rank queues every group, so 2 ranks sample and lag exactly as 1."""
    weights, rewards = {}, {}
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}"
        done = run(grpo_overrides(tiny_model_dir, rl_data, out, **{
            "train.max_steps": 3, "train.batch_size": 4, "rl.max_staleness": 1, "rl.is_correction": "tis"}),
            nproc=nproc)
        assert done.returncode == 0, done.stderr[-3000:]
        weights[nproc] = final_weights(out)
        steps = steps_of(out)
        assert_lag(steps, 1)
        rewards[nproc] = [r["reward_mean"] for r in steps]
    assert rewards[2] == rewards[1]
    for name, tensor in weights[1].items():  # sharded reductions sum in another order (test_grpo_runs.py)
        torch.testing.assert_close(weights[2][name], tensor, atol=1e-4, rtol=1e-3)
