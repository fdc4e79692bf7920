"""Off-policy plumbing (posttrain.rl.offpolicy and the GRPO source's queue), in process: the trainer's
log-probs of a rollout, queued rollouts through JSON bit for bit, and "step s samples with the weights of
step s − k" checked against a synchronous source holding those weights."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.config.loader import load_config
from posttrain.config.rl import GRPORecipe
from posttrain.rl.offpolicy import decode_rollout, encode_rollout, token_layout
from posttrain.rl.rewards import RewardFunction
from posttrain.rl.rollout import Rollout, completion_logprobs, rollout_batch
from posttrain.rl.source import Group, Queued, Sample
from posttrain.train.grpo import build_grpo
from tests.rl.conftest import grpo_overrides


def config_of(model: str, data: str, out, **extra) -> GRPORecipe:
    return load_config(GRPORecipe, "grpo_tiny", grpo_overrides(model, data, out, **extra))


def awkward_rollout(**changes) -> Rollout:
    values = {"prompt_key": 7, "sample_index": 3, "prompt_ids": [1, 2, 150_000], "completion_ids": [5, 0, 2**31 - 1],
              # float32 values, a denormal, a float64 that no float32 holds: all must come back bit for bit
              "logprobs": [-2.384185791015625e-07, -1e-310, -0.1], "finish_reason": "length", "truncated": True,
              "text": "é\u2028\"x", "temperature": 0.7, "version": 12, "train_logprobs": [-87.33654, -0.0, -1 / 3]}
    values.update(changes)
    return Rollout(**values)


def test_a_rollout_goes_through_json_exactly():
    for rollout in (awkward_rollout(), awkward_rollout(train_logprobs=None, version=0)):
        back = decode_rollout(json.loads(json.dumps(encode_rollout(rollout))))
        assert back == rollout
        assert [x.hex() for x in back.logprobs] == [x.hex() for x in rollout.logprobs]


@pytest.mark.parametrize(("change", "message"), [
    ({"logprobs": "not base64!"}, "logprobs is not base64"),
    ({"completion_ids": "AAA="}, "not a whole number"),
    ({"version": "3"}, "version"),
    ({"truncated": 1}, "truncated"),
    ({"train_logprobs": "AAAAAAAAAAA="}, "one log-prob per completion token"),
])
def test_a_malformed_queued_rollout_is_refused(change, message):
    data = {**encode_rollout(awkward_rollout()), **change}
    with pytest.raises(ValueError, match=message):
        decode_rollout(data)


def test_a_queued_step_goes_through_json_exactly():
    groups = [Group(0, 5, [Sample(awkward_rollout(), 0.1 + 0.2, None), Sample(awkward_rollout(text="b"), -1.5, True)])]
    queued = Queued(step=9, version=8, groups=groups, metrics={"reward_mean": 1 / 3, "sampling_rounds": 1},
                    outcomes={5: (1, 2), 11: (0, 4)})
    assert Queued.decode(json.loads(json.dumps(queued.encode()))) == queued
    with pytest.raises(ValueError, match="queued rollouts are malformed"):
        Queued.decode({"step": 9})


def test_token_layout_is_the_layout_of_the_old_logprobs():
    rollouts = [awkward_rollout(), awkward_rollout(prompt_ids=[4], completion_ids=[9, 9, 9, 9, 9],
                                                   logprobs=[-1.0] * 5, train_logprobs=[-2.0] * 5)]
    batch = rollout_batch(rollouts, pad_id=0, temperature=0.7)
    laid = token_layout(rollouts, [r.logprobs for r in rollouts], batch["labels"].shape[1])
    assert torch.equal(laid, batch["old_logprobs"])
    with pytest.raises(ValueError, match="completion tokens but 1 values"):
        token_layout(rollouts[:1], [[0.0]], 6)


def test_the_trainer_scores_each_rollout_with_the_sampling_weights(tiny_model_dir, rl_data, tmp_path):
    config = config_of(tiny_model_dir, rl_data, tmp_path / "run", **{"rl.is_correction": "tis"})
    with RewardFunction(config.reward) as rewards:
        parts = build_grpo(config, rewards)
        batch = parts.source.next_step(0, parts.root)
    samples = [s for s, _ in parts.source.last_sequences]
    assert all(s.rollout.version == 0 and len(s.rollout.train_logprobs) == len(s.completion_ids) for s in samples)
    behaviour = torch.tensor([x for s in samples for x in s.logprobs])
    train = torch.tensor([x for s in samples for x in s.rollout.train_logprobs])
    assert 0 < float((train - behaviour).abs().max()) < 1e-4  # two code paths, one model: float noise only
    # The training forward (train mode, the loss's batches) gives the recomputed numbers
    with torch.no_grad():
        forward = torch.cat([completion_logprobs(parts.root, m, config.rl.temperature)[m["labels"] != -100]
                             for m in batch.micro_batches])
    old = torch.cat([m["old_logprobs"][m["labels"] != -100] for m in batch.micro_batches])
    sampler = torch.cat([m["behaviour_logprobs"][m["labels"] != -100] for m in batch.micro_batches])
    torch.testing.assert_close(forward, old, rtol=0, atol=1e-6)
    assert sorted(old.tolist()) == sorted(train.tolist()) and sorted(sampler.tolist()) == sorted(behaviour.tolist())
    assert batch.log["rollout/logprob_abs_diff_max"] == pytest.approx(float((train - behaviour).abs().max()))


def _perturb(root: torch.nn.Module, scale: float) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in root.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)


def _completions(groups) -> list[tuple[list[int], list[float]]]:
    return [(s.completion_ids, s.logprobs) for g in groups for s in g.samples]


def test_step_s_trains_on_rollouts_sampled_with_the_weights_of_step_s_minus_k(tiny_model_dir, rl_data, tmp_path):
    """k = 1, driven by hand: the weights change between steps as an optimizer step would change them."""
    config = config_of(tiny_model_dir, rl_data, tmp_path / "lagged", **{"rl.max_staleness": 1})
    synchronous = config_of(tiny_model_dir, rl_data, tmp_path / "sync")
    with RewardFunction(config.reward) as rewards:
        lagged = build_grpo(config, rewards)
        lagged.source.next_step(0, lagged.root)  # warm-up: steps 0 and 1 sampled with the weights of step 0
        step0 = lagged.source.last_groups
        assert [q.step for q in lagged.source.queue] == [1] and lagged.source.queue[0].version == 0
        _perturb(lagged.root, 0.05)  # "step 0's update"
        batch = lagged.source.next_step(1, lagged.root)  # trains step 1's rollouts (version 0), samples step 2's
        step1 = lagged.source.last_groups
        assert batch.log["rollout/staleness_max"] == 1 and batch.log["rollout/version_max"] == 0
        assert [(q.step, q.version) for q in lagged.source.queue] == [(2, 1)]
        step2 = lagged.source.queue[0].groups

        # A synchronous source with the weights of step 0 samples steps 0 and 1 exactly as the lagged one did
        reference = build_grpo(synchronous, rewards)
        reference.source.next_step(0, reference.root)
        assert _completions(reference.source.last_groups) == _completions(step0)
        reference.source.next_step(1, reference.root)
        assert _completions(reference.source.last_groups) == _completions(step1)
        # ... and with the weights of step 1 it samples step 2 as the lagged one did one step early
        _perturb(reference.root, 0.05)
        reference.source.next_step(2, reference.root)
        assert _completions(reference.source.last_groups) == _completions(step2)
        assert _completions(step2) != _completions(step1)


@pytest.mark.parametrize("skip", ["true", "false"])
def test_groups_without_signal_are_scored_only_when_they_are_trained(tiny_model_dir, rl_data, tmp_path, skip):
    config = config_of(tiny_model_dir, rl_data, tmp_path / "run", **{
        "reward.terms": '[{"kind": "python", "function": "tests.rl.grpo_rewards:signal_on_even_answers"}]',
        "rl.is_correction": "tis", "rl.skip_zero_advantage": skip})
    with RewardFunction(config.reward) as rewards:
        parts = build_grpo(config, rewards)
        batch = parts.source.next_step(0, parts.root)
    groups = parts.source.last_groups
    assert {g.has_signal for g in groups} == {True, False}  # odd answers: a constant reward
    for group in groups:
        scored = [s.rollout.train_logprobs is not None for s in group.samples]
        assert scored == [group.has_signal or skip == "false"] * len(group.samples)
    assert len(batch.micro_batches) >= 1 and "rollout/logprob_abs_diff" in batch.log
