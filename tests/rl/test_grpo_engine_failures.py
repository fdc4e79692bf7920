"""GRPO with rollout.engine=vllm when the engine fails, against the stdlib stand-in for vLLM's server
(tests/generate/fake_vllm_server.py): the engine dies mid-run and is restarted (the weights re-synced), dies
again and the run exits 75 with its checkpoint, and the rerun resumes and finishes; SIGTERM stops the engine
with the run. The real engine is tests/rl/test_vllm_engine.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.generate.test_vllm_server import _gone, fake_engine_python
from tests.rl.conftest import grpo_overrides
from tests.train.conftest import ROOT, env, read_jsonl, sigterm_after


@pytest.fixture
def fake_python(tmp_path) -> str:
    return fake_engine_python(tmp_path)


def _grpo(model: str, data: str, out: Path, python: str, env_extra: dict, **extra) -> subprocess.CompletedProcess:
    overrides = grpo_overrides(model, data, out, **{"rollout.engine": "vllm", "rollout.engine_python": python,
                                                    "rollout.start_timeout_s": 120, "train.save_every": 2, **extra})
    return subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--config", "grpo_tiny", *overrides], cwd=ROOT,
                          env={**env(), **env_extra}, capture_output=True, text=True, timeout=600)


def test_grpo_restarts_a_dead_engine_then_exits_75_and_resumes(tiny_model_dir, rl_data, fake_python, tmp_path):
    out = tmp_path / "run"
    starts = tmp_path / "starts.txt"
    # Each GRPO step sends 4 requests (one per prompt), each start one warm-up request first. Start 1 dies during
    # step 1; the restart (start 2) answers step 1 again, then dies during step 2, after the checkpoint written when
    # step 1 ended: exit 75. The rerun's engine (start 3) is healthy and the run finishes.
    fake = {"FAKE_VLLM_STARTS": str(starts), "FAKE_VLLM_DIE_AFTER": "7,8,-1"}
    crashed = _grpo(tiny_model_dir, rl_data, out, fake_python, fake)
    assert crashed.returncode == 75, crashed.stderr[-3000:]
    assert "restarted 1 time(s) and failed again" in crashed.stderr and "rerun the same command" in crashed.stderr
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    why = f"{crashed.stderr[-2000:]}\n{(out / 'engine.log').read_text()[-2000:]}"
    assert [r["step"] for r in steps] == [0, 1], why
    assert steps[0]["rollout/sync_bytes"] > 0 and "rollout/sync_s" in steps[0]
    assert steps[1]["rollout/engine_restarts"] == 1
    assert (out / "checkpoints" / "step-000002" / "manifest.json").exists() and not (out / "final").exists()
    assert len(starts.read_text().splitlines()) == 2, why
    pids = [int(line) for line in starts.read_text().splitlines()]
    assert all(_gone(pid) for pid in pids)  # no engine outlives its trainer

    resumed = _grpo(tiny_model_dir, rl_data, out, fake_python, fake)
    assert resumed.returncode == 0, f"{resumed.stderr[-3000:]}\n{(out / 'engine.log').read_text()[-2000:]}"
    assert "resumed" in [a["kind"] for a in read_jsonl(out / "alerts.jsonl")]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] == [0, 1, 2, 3]
    assert (out / "final" / "model.safetensors").exists() and len(starts.read_text().splitlines()) == 3
    assert "==== posttrain: starting the engine" in (out / "engine.log").read_text()
    assert json.loads((out / "finished.json").read_text())["steps"] == 4


def test_sigterm_stops_the_engine_with_the_run(tiny_model_dir, rl_data, fake_python, tmp_path):
    out = tmp_path / "run"
    starts = tmp_path / "starts.txt"
    overrides = grpo_overrides(tiny_model_dir, rl_data, out, **{"rollout.engine": "vllm", "train.max_steps": 400,
                                                                "rollout.engine_python": fake_python})
    command = [sys.executable, "-m", "posttrain", "grpo", "--config", "grpo_tiny", *overrides]
    os.environ["FAKE_VLLM_STARTS"] = str(starts)  # sigterm_after's child inherits os.environ
    try:
        code, err = sigterm_after(command, out, records=2)
    finally:
        del os.environ["FAKE_VLLM_STARTS"]
    assert code == 75, err[-2000:]
    pid = int(starts.read_text().split()[0])
    deadline = time.monotonic() + 30
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(pid)


@pytest.mark.slow
def test_two_ranks_share_one_engine_and_sample_what_one_rank_does(tiny_model_dir, rl_data, fake_python, tmp_path):
    rewards = {}
    for nproc in (1, 2):
        out, starts, reloads = tmp_path / f"ranks{nproc}", tmp_path / f"starts{nproc}.txt", tmp_path / f"reloads{nproc}.txt"
        overrides = grpo_overrides(tiny_model_dir, rl_data, out, **{
            "rollout.engine": "vllm", "rollout.engine_python": fake_python, "train.max_steps": 3,
            "train.batch_size": 4})
        launcher = ([] if nproc == 1 else
                    ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"])
        done = subprocess.run([sys.executable, *launcher, "-m", "posttrain", "grpo", "--config", "grpo_tiny", *overrides],
                              cwd=ROOT, env={**env(), "FAKE_VLLM_STARTS": str(starts), "FAKE_VLLM_RELOADS": str(reloads)},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert len(starts.read_text().splitlines()) == 1  # rank 0 starts the one engine every rank samples from
        assert len(reloads.read_text().splitlines()) == 3  # one sync per step (rank 0 writes, the engine reloads)
        steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
        assert all(r["rollout/sync_bytes"] > 0 for r in steps)
        rewards[nproc] = [r["reward_mean"] for r in steps]
    assert rewards[2] == rewards[1]  # a prompt's samples depend on its seed key, not on the rank that sent it


def test_episodes_on_an_engine_that_dies_mid_step_are_run_again_after_the_restart(tiny_model_dir, rl_data, fake_python,
                                                                                  tmp_path):
    """``env:`` on the engine: start 1 dies while the first step's episodes are half sampled (each model turn of
    each episode is one request; the stand-in samples uniform tokens, so every turn runs to env.max_turn_tokens and
    AnswerOnce's tool turn follows the first); the restarted engine is re-synced and runs the step's episodes again
    from the start, and the run ends normally."""
    from tests.rl.test_tool_runs import SETTINGS

    out, starts = tmp_path / "run", tmp_path / "starts.txt"
    settings = {**SETTINGS, "train.max_steps": 2}
    overrides = grpo_overrides(tiny_model_dir, rl_data, out, **{
        **settings, "rollout.engine": "vllm", "rollout.engine_python": fake_python, "rollout.start_timeout_s": 120})
    done = subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--config", "grpo_tools_tiny", *overrides],
                          cwd=ROOT, env={**env(), "FAKE_VLLM_STARTS": str(starts), "FAKE_VLLM_DIE_AFTER": "10,-1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1] and steps[0]["rollout/engine_restarts"] == 1
    assert len(starts.read_text().splitlines()) == 2
    for record in steps:  # every episode whole: two model turns around a masked tool turn
        assert record["episode/turns_mean"] == 2 and 0 < record["episode/env_token_share"] < 1, record
