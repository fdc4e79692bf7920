"""GRPO with episodes as processes: SIGKILL then resume gives the uninterrupted run's final weights bit for bit
(with rollouts queued ahead, rl.max_staleness=1, so episodes with masked tool turns go through the checkpoint), and
2 ranks train like 1; each run ends with a held-out evaluation of greedy episodes (data.eval), which the resumed run
repeats exactly and 2 ranks split. One uninterrupted run serves both comparisons.

A random tiny model never writes a tool call, so these runs use ``AnswerOnce``: a deterministic environment that
answers every episode's first turn (a tool turn, masked from the loss) and ends it at the second. The sandboxed
Python tool itself is tested in test_tools.py and through the built-in task in test_tool_task.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from posttrain.data.io import write_records
from posttrain.rl.envs import EnvStep
from posttrain.rl.offpolicy import decode_rollout
from posttrain.tasks import rl_prompts
from tests.rl.conftest import grpo_overrides, killed_and_resumed
from tests.rl.test_grpo_runs import run
from tests.train.conftest import final_weights, read_jsonl

run_tools = functools.partial(run, config="grpo_tools_tiny")


class AnswerOnce:
    """Every episode: model turn, a tool turn (``<n> characters``, n the model turn's length), model turn, done
    (an episode whose first turn ends at EOS is done without a tool turn)."""

    def __init__(self, config):
        self.turns = 0

    def reset(self, item):
        return list(item.prompt)

    def step(self, text):
        self.turns += 1
        if self.turns > 1:
            return EnvStep(done=True)
        return EnvStep(f"{len(text)} characters", info={"tool_call": True, "tool_status": "ok", "tool_s": 0.0})


SETTINGS = {"train.max_length": 384, "rl.max_new_tokens": 40, "env.max_turn_tokens": 12, "env.max_turns": 2,
            "env.name": "python:tests.rl.test_tool_runs:AnswerOnce", "train.max_steps": 3, "train.save_every": 1,
            "train.batch_size": 4, "rl.max_staleness": 1, "rl.is_correction": "tis", "rl.pass_rate_low": 0.0,
            "rl.pass_rate_high": 0.99, "rl.pass_rate_min_tries": 4}


def steps_of(out) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> str:
    """4 held-out prompts: every run also evaluates them as greedy episodes (data.eval) at its end."""
    path = tmp_path_factory.mktemp("tools-eval") / "eval.jsonl"
    write_records(str(path), rl_prompts(4, 0, split="eval", groups=["reasoning"]))
    return str(path)


def overrides_of(model: str, data: str, eval_data: str, out) -> list[str]:
    return grpo_overrides(model, data, out, **{**SETTINGS, "data.eval": eval_data})


def eval_of(out) -> dict:
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/reward" in r]
    assert len(records) == 1, records
    return records[0]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, rl_data, held_out, tmp_path_factory):
    out = tmp_path_factory.mktemp("tools") / "clean"
    done = run_tools(overrides_of(tiny_model_dir, rl_data, held_out, out))
    assert done.returncode == 0, done.stderr[-3000:]
    steps = steps_of(out)
    assert [r["step"] for r in steps] == [0, 1, 2]
    for record in steps:  # episodes whose first turn did not end at EOS had a tool turn
        assert record["episode/tool_call_rate"] > 0.5 and record["episode/turns_mean"] > 1.5, record
        assert 0 < record["episode/env_token_share"] < 1 and record["episode/failed_share"] == 0
    figures = eval_of(out)  # greedy episodes with the environment: the tool turn happens there too
    assert figures["eval/prompts"] == 4 and figures["eval/turns_mean"] > 1 and figures["eval/tool_call_rate"] > 0
    return out


def queued_episodes(out) -> None:
    state = json.loads((out / "checkpoints" / "step-000001" / "trainer.json").read_text())
    queue = state["source"]["queue"]
    assert [(q["step"], q["version"]) for q in queue] == [(1, 0)]
    rollouts = [decode_rollout(s["rollout"]) for g in queue[0]["groups"] for s in g["samples"]]
    assert any(0 in r.loss_mask for r in rollouts) and all(r.episode is not None for r in rollouts)


def test_sigkill_then_resume_with_episodes_is_bit_identical(uninterrupted, tiny_model_dir, rl_data, held_out,
                                                            tmp_path):
    out = tmp_path / "killed"
    overrides = overrides_of(tiny_model_dir, rl_data, held_out, out)
    # killed after step 1: its checkpoint's queue holds step 1's episodes (sampled at step 0), masks included; the
    # resumed run trains them, then samples step 2's from the restored weights
    killed_and_resumed(run_tools, overrides, out, crash_at=1, check=queued_episodes)
    expected, got = final_weights(uninterrupted), final_weights(out)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    logs = [steps_of(d) for d in (uninterrupted, out)]
    for key in ("reward_mean", "episode/env_token_share", "episode/turns_mean"):
        assert [r[key] for r in logs[0]] == [r[key] for r in logs[1]], key
    assert eval_of(out) | {"time": 0} == eval_of(uninterrupted) | {"time": 0}


@pytest.mark.slow
def test_two_ranks_train_on_episodes_like_one(uninterrupted, tiny_model_dir, rl_data, held_out, tmp_path):
    out = tmp_path / "ranks2"
    done = run_tools(overrides_of(tiny_model_dir, rl_data, held_out, out), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [steps_of(d) for d in (uninterrupted, out)]
    for key in ("reward_mean", "episode/env_token_share"):  # each episode does not depend on the rank that ran it
        assert [r[key] for r in logs[0]] == [r[key] for r in logs[1]], key
    expected, got = final_weights(uninterrupted), final_weights(out)
    for name, tensor in expected.items():  # sharded reductions sum in another order (test_grpo_runs.py)
        torch.testing.assert_close(got[name], tensor, atol=1e-4, rtol=1e-3)
    one, two = eval_of(uninterrupted), eval_of(out)  # 2 held-out prompts per rank, summed over ranks
    for key in ("eval/prompts", "eval/tool_call_rate", "eval/turns_mean"):
        assert two[key] == one[key], key


def test_the_report_shows_the_episodes(uninterrupted):
    """The run's HTML report has the episodes panel: per-step tool-call rate, turns, tool-error and failed shares
    (and the held-out tool-call rate), drawn from metrics.jsonl."""
    from posttrain.report import write_report
    from posttrain.report.collect import training_series

    series = training_series(uninterrupted)
    steps = steps_of(uninterrupted)
    assert series["episodes"]["tool_call_rate"] == [r["episode/tool_call_rate"] for r in steps]
    assert series["episodes"]["turns_mean"] == [r["episode/turns_mean"] for r in steps]
    assert series["eval"]["tool_call_rate"] == [eval_of(uninterrupted)["eval/tool_call_rate"]]
    html = open(write_report(uninterrupted)["html"]).read()
    assert "chart-" in html and "episodes (tool calls, turns, failures)" in html
