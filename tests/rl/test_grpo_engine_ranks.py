"""GRPO with an engine of its own (the stdlib stand-in for vLLM's server) on 2 ranks: every rank sends its own
prompts to the one engine rank 0 started, the trainer's log-prob recompute runs each rank's own rollouts (an
uneven number when zero-signal groups are skipped), and overlapped sampling (rl.max_staleness=1) trains what 1
rank trains."""

from __future__ import annotations

import pytest
import torch

from tests.generate.test_vllm_server import fake_engine_python
from tests.rl.conftest import grpo_overrides
from tests.rl.test_grpo_runs import run
from tests.rl.test_staleness import assert_lag, steps_of
from tests.train.conftest import final_weights


@pytest.mark.slow
def test_two_ranks_on_one_engine_with_overlap_train_like_one(tiny_model_dir, rl_data, tmp_path):
    python = fake_engine_python(tmp_path)
    weights, rewards = {}, {}
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}"
        done = run(grpo_overrides(tiny_model_dir, rl_data, out, **{
            "rollout.engine": "vllm", "rollout.engine_python": python, "train.max_steps": 2, "train.batch_size": 4,
            "rl.max_staleness": 1, "rl.is_correction": "tis"}), nproc=nproc)
        assert done.returncode == 0, done.stderr[-3000:]
        weights[nproc], steps = final_weights(out), steps_of(out)
        assert_lag(steps, 1)
        rewards[nproc] = [r["reward_mean"] for r in steps]
    assert rewards[2] == rewards[1]
    for name, tensor in weights[1].items():  # sharded reductions sum in another order (test_grpo_runs.py)
        torch.testing.assert_close(weights[2][name], tensor, atol=1e-4, rtol=1e-3)
