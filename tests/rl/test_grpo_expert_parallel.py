"""GRPO with expert parallelism (``parallel.expert: 2``) on 2 ranks, against the stdlib stand-in for vLLM's server
(tests/generate/fake_vllm_server.py): the engine samples, so only the trainer's forwards must run in lockstep.
With ``rl.measure_mismatch`` each rank recomputes the log-probs of its own rollouts with signal, and a reward
without signal on odd answers leaves the ranks different numbers of them (posttrain/rl/offpolicy.py pads the
shorter ranks with dummy forwards); a missing pad would hang the run, which the timeout turns into a failure.
At ``parallel.expert: 1`` (plain FSDP2) the same uneven recompute once hung too: FSDP2 kept the order of those
no-grad forwards and prefetched along it in the next backward, one all-gather more on the rank that ran more
(posttrain/rl/rollout.py, ``_forget_forward_order``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.generate.test_vllm_server import fake_engine_python
from tests.rl.conftest import grpo_overrides
from tests.train.conftest import ROOT, env, read_jsonl
from tests.train.test_expert_parallel import tiny_qwen3_moe


@pytest.mark.slow
@pytest.mark.parametrize("expert", [2, 1])
def test_two_grpo_steps_with_the_engine_and_uneven_recompute(expert, tiny_model_dir, rl_data, tmp_path):
    moe = tiny_qwen3_moe(tiny_model_dir, tmp_path / "moe")
    out = tmp_path / "run"
    overrides = grpo_overrides(moe, rl_data, out, **{
        "train.max_steps": 2, "train.batch_size": 4, "rl.measure_mismatch": "true", "parallel.expert": expert,
        "reward.terms": '[{"kind": "python", "function": "tests.rl.grpo_rewards:signal_on_even_answers"}]',
        "rollout.engine": "vllm", "rollout.engine_python": fake_engine_python(tmp_path),
        "rollout.start_timeout_s": 120})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "posttrain", "grpo", "--config", "grpo_tiny", *overrides]
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"'expert_parallel': {expert}, 'ep_layers': {2 if expert > 1 else 0}" in proc.stderr
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(0 < r["zero_signal_share"] < 1 for r in steps)  # some groups skipped: not every rollout is scored
    assert (out / "final" / "model.safetensors").exists()
