"""Overlapped sampling (``rollout.overlap`` with ``rl.max_staleness=1``) against the stdlib stand-in for vLLM's
server: the engine samples step s+1's rollouts while step s trains — shown from the server's own request times
and the trainer's forward times — and the run trains exactly what the same run without overlap trains (the
rollouts are finished before the optimizer step, with the weights that sampled them). The real engine's
figures are benchmarks/grpo_staleness.py's."""

from __future__ import annotations

import time

import pytest
import torch

from posttrain.cli import main
from tests.generate.test_vllm_server import fake_engine_python
from tests.rl.conftest import grpo_overrides
from tests.rl.test_staleness import assert_lag, steps_of
from tests.train.conftest import final_weights


@pytest.fixture
def fake_python(tmp_path) -> str:
    return fake_engine_python(tmp_path)


def test_the_engine_samples_while_the_step_trains_and_the_run_is_the_same(tiny_model_dir, rl_data, fake_python,
                                                                          tmp_path, monkeypatch):
    import posttrain.train.loop as loop

    monkeypatch.setenv("FAKE_VLLM_DELAY_S", "0.5")  # each request takes long next to a tiny model's forward
    forwards: list[float] = []
    original = loop.autocast

    def timed_autocast(*args, **kwargs):  # the loop's training forwards (not the trainer's log-prob forward)
        forwards.append(time.time())
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "autocast", timed_autocast)
    runs = {}
    for overlap in (True, False):
        times = tmp_path / f"requests-{overlap}.txt"
        monkeypatch.setenv("FAKE_VLLM_TIMES", str(times))
        forwards.clear()
        out = tmp_path / f"run-overlap-{overlap}"
        assert main(["grpo", "--config", "grpo_tiny", *grpo_overrides(tiny_model_dir, rl_data, out, **{
            "rollout.engine": "vllm", "rollout.engine_python": fake_python, "rollout.overlap": str(overlap).lower(),
            "rl.max_staleness": 1, "rl.is_correction": "tis", "train.max_steps": 4})]) == 0
        spans = [tuple(map(float, line.split())) for line in times.read_text().splitlines()]
        during = sum(any(start < t < end for start, end in spans) for t in forwards)
        runs[overlap] = (final_weights(out), steps_of(out), during, len(forwards))
    (overlapped, steps, during, forward_count), (serial, serial_steps, serial_during, _) = runs[True], runs[False]
    assert serial_during == 0  # without overlap the engine is idle while the step trains
    assert during > 0, f"no training forward ran while the engine sampled ({forward_count} forwards)"
    assert overlapped.keys() == serial.keys() and all(torch.equal(overlapped[k], serial[k]) for k in serial)
    for key in ("loss", "reward_mean", "rollout/logprob_abs_diff", "rollout/version_min"):
        assert [r[key] for r in steps] == [r[key] for r in serial_steps], key
    assert_lag(steps, 1)
    assert all(r["rollout/engine_lag"] == 0 for r in steps[:-1])
    # the rollouts of steps 1..3 were finished inside steps 0..2 (before_update); step 3 samples nothing
    assert all(r["time/rollout_wait_s"] >= 0 and r["time/generate_s"] > 0 for r in steps[:-1])
    assert "time/generate_s" not in steps[-1] and all(r["generated_tokens"] > 0 for r in steps)

