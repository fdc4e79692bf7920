"""GRPO in process: the recipe end to end, the direction of one update, accumulation equivalence, dynamic
sampling, overlong shaping and truncation masking, the KL term, and the health guard."""

from __future__ import annotations

import json
import math

import pytest
import torch

from posttrain.cli import main
from posttrain.config.loader import load_config
from posttrain.config.rl import GRPORecipe
from posttrain.rl.rewards import RewardFunction
from posttrain.rl.rollout import completion_logprobs
from posttrain.train.grpo import build_grpo, grpo_loss
from tests.rl.conftest import grpo_overrides
from tests.train.conftest import final_weights, read_jsonl


def config_of(model: str, data: str, out, **extra) -> GRPORecipe:
    return load_config(GRPORecipe, "grpo_tiny", grpo_overrides(model, data, out, **extra))


def sequence_logprobs(parts, batch, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        values = []
        for micro in batch.micro_batches:
            values.append(completion_logprobs(parts.root, micro, temperature).sum(dim=1))
    return torch.cat(values)


def test_the_recipe_runs_and_logs_what_rl_needs(tiny_model_dir, rl_data, tmp_path):
    out = tmp_path / "run"
    terms = '[{"kind": "verifier"}, {"kind": "python", "function": "tests.rl.grpo_rewards:letter_share"}]'
    assert main(["grpo", "--config", "grpo_tiny", *grpo_overrides(tiny_model_dir, rl_data, out,
                                                                  **{"reward.terms": terms})]) == 0
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    for key in ("reward_mean", "reward_std", "pass@1", "pass@4", "zero_signal_share", "clip_fraction", "entropy",
                "completion_len_mean", "completion_len_max", "truncated_share", "time/generate_s", "time/train_s",
                "generated_tokens_per_s"):
        assert key in steps[0], key
    # The first update is on-policy: the training forward gives the log-probs recorded at sampling time.
    assert abs(steps[0]["log_ratio"]) < 1e-4 and steps[0]["clip_fraction"] == 0.0
    assert (out / "final" / "model.safetensors").exists()
    assert json.loads((out / "finished.json").read_text())["steps"] == 4


def test_one_update_raises_the_likelihood_of_advantaged_completions(tiny_model_dir, rl_data, tmp_path):
    config = config_of(tiny_model_dir, rl_data, tmp_path / "run")
    with RewardFunction(config.reward) as rewards:
        parts = build_grpo(config, rewards)
        batch = parts.source.next_step(0, parts.root)
        advantages = torch.cat([micro["advantages"] for micro in batch.micro_batches])
        assert advantages.abs().sum() > 0  # the dense reward gives every group signal
        before = sequence_logprobs(parts, batch, config.rl.temperature)
        loss = grpo_loss(config)
        parts.root.zero_grad()
        for micro in batch.micro_batches:
            numerator, _ = loss(parts.root, micro)
            (numerator / batch.normalizer[0]).backward()
        with torch.no_grad():
            for p in parts.root.parameters():
                if p.grad is not None:
                    p -= 0.05 * p.grad
        after = sequence_logprobs(parts, batch, config.rl.temperature)
    change = after - before
    # To first order Σ A·Δlog π = lr·|∇|² > 0: completions with positive advantage gained likelihood.
    assert float((advantages * change).sum()) > 0
    assert float(change[advantages.argmax()]) > 0 > float(change[advantages.argmin()])


@pytest.mark.parametrize(("name", "variants"), [
    ("accumulation", [{"train.batch_size": 16}, {"train.batch_size": 4}]),  # 1 and 4 micro-batches per step
    # Zero-advantage completions left out of the forward (the default) or trained with their exact-0 term.
    ("zero_advantage", [{"rl.skip_zero_advantage": "true"}, {"rl.skip_zero_advantage": "false"}]),
])
def test_the_update_does_not_depend_on_how_the_batch_is_cut(tiny_model_dir, rl_data, tmp_path, name, variants):
    terms = '[{"kind": "python", "function": "tests.rl.grpo_rewards:signal_on_even_answers"}]'  # some groups: A = 0
    weights, rewards, trained = [], [], []
    for index, variant in enumerate(variants):
        out = tmp_path / f"{name}{index}"
        assert main(["grpo", "--config", "grpo_tiny", *grpo_overrides(
            tiny_model_dir, rl_data, out, **{"train.max_steps": 2, "reward.terms": terms, **variant})]) == 0
        weights.append(final_weights(out))
        steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
        rewards.append([r["reward_mean"] for r in steps])
        trained.append([r["trained_completions"] for r in steps])
    assert rewards[0] == rewards[1]  # the same completions were sampled at both steps
    if name == "zero_advantage":
        assert trained[0] < trained[1] == [16, 16]  # the skip left some out, and still made the same update
    # Adam divides by sqrt(v): summation-order noise in a near-zero gradient can move that element by up to
    # ~lr (1e-3) per step, so weights agree to 10% of one step (as the SFT equivalence tests), not to epsilon.
    for key, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][key], tensor, atol=1e-4, rtol=1e-3)


def test_dynamic_sampling_keeps_only_groups_with_signal(tiny_model_dir, rl_data, tmp_path):
    config = config_of(tiny_model_dir, rl_data, tmp_path / "run", **{
        "reward.terms": '[{"kind": "python", "function": "tests.rl.grpo_rewards:signal_on_even_answers"}]',
        "rl.dynamic_sampling": "true", "rl.max_sampling_rounds": 4})
    with RewardFunction(config.reward) as rewards:
        parts = build_grpo(config, rewards)
        batch = parts.source.next_step(0, parts.root)
    source = parts.source
    short = source.counters["dynamic_sampling_short"]
    assert len(source.last_groups) == 4
    assert sum(not g.has_signal for g in source.last_groups) == short
    odd = [g for g in source.last_groups if int(source.prompts[g.prompt_index].answer) % 2]
    assert len(odd) == short  # an odd answer's group is constant: kept only to fill a short batch
    assert batch.log["prompts_sampled"] >= 4 and batch.log["sampling_rounds"] >= 1
    if batch.log["prompts_sampled"] > 4:
        assert batch.log["sampling_rounds"] > 1 and batch.log["zero_signal_share"] > 0


def test_overlong_shaping_and_truncation_mask(tiny_model_dir, rl_data, tmp_path):
    config = config_of(tiny_model_dir, rl_data, tmp_path / "run", **{
        "reward.terms": '[{"kind": "python", "function": "tests.rl.grpo_rewards:constant_half"}]',
        "rl.overlong_buffer": 4, "rl.overlong_penalty": 1.0, "rl.mask_truncated": "true", "rl.advantage": "dr_grpo",
        "rl.skip_zero_advantage": "false"})
    with RewardFunction(config.reward) as rewards:
        parts = build_grpo(config, rewards)
        batch = parts.source.next_step(0, parts.root)
    samples = [s for s, _ in parts.source.last_sequences]
    for sample in samples:  # L = 8, B = 4: no penalty up to 4 tokens, 1/4 per token after, 1 at the cap
        length = len(sample.completion_ids)
        assert sample.reward == pytest.approx(0.5 - min(max(length - 4, 0), 4) / 4)
    trained_rows = [row for m in batch.micro_batches for row in (m["labels"] != -100).any(dim=1).tolist()]
    assert trained_rows == [not s.truncated for s in samples]
    assert batch.loss_tokens == sum(len(s.completion_ids) for s in samples if not s.truncated)


def test_kl_to_the_reference_is_zero_before_the_first_update(tiny_model_dir, rl_data, tmp_path):
    config = config_of(tiny_model_dir, rl_data, tmp_path / "run", **{"rl.kl_beta": 0.1})
    with RewardFunction(config.reward) as rewards:
        parts = build_grpo(config, rewards)
        batch = parts.source.next_step(0, parts.root)
        loss = grpo_loss(config)
        kl = sum(float(loss(parts.root, micro)[1]["kl"]) for micro in batch.micro_batches)
    assert all("ref_logprobs" in micro for micro in batch.micro_batches)
    assert math.isfinite(kl) and abs(kl) < 1e-6


def test_the_health_guard_skips_a_spiking_step(tiny_model_dir, rl_data, tmp_path):
    out = tmp_path / "run"
    assert main(["grpo", "--config", "grpo_tiny", *grpo_overrides(
        tiny_model_dir, rl_data, out, **{"debug.spike_steps": "[2]", "train.max_steps": 4})]) == 0
    skipped = [a for a in read_jsonl(out / "alerts.jsonl") if a["kind"] == "skipped_update"]
    assert [a["step"] for a in skipped] == [2] and "grad norm" in skipped[0]["reason"]


def test_lora_grpo_uses_the_adapter_disabled_base_as_its_reference(tiny_model_dir, rl_data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["grpo", "--config", "grpo_tiny", *grpo_overrides(
        tiny_model_dir, rl_data, out, **{"model.lora.r": 4, "rl.kl_beta": 0.1, "train.lr": 1e-2})]) == 0
    assert "the policy with its LoRA adapters disabled" in capsys.readouterr().err
    kl = [r["kl"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # LoRA starts as the identity: the policy is the base
    assert kl[-1] > 1e-6  # the adapters moved the policy away from the base it is measured against
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "final" / "model.safetensors").exists()
