"""Equivalence: accumulation and rank count must not change the update (loss ÷ global token count)."""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from posttrain.train.identity import config_identity
from tests.train.conftest import base_overrides, final_weights, read_jsonl, run_in_process, run_subprocess


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_same_trajectory(run_a, run_b, weight_atol=1e-4):
    """Per-step loss and grad norm agree tightly; weights agree to a tenth of one Adam step (lr 1e-3).

    Adam divides by sqrt(v): float32 rounding in a near-zero gradient becomes a visible update, so the
    weights get a tolerance tied to the step size while loss and grad norm get a relative 1e-5.
    """
    steps_a = [m for m in read_jsonl(run_a / "metrics.jsonl") if "loss" in m]
    steps_b = [m for m in read_jsonl(run_b / "metrics.jsonl") if "loss" in m]
    assert len(steps_a) == len(steps_b) > 0
    for x, y in zip(steps_a, steps_b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)
    assert max_diff(final_weights(run_a), final_weights(run_b)) < weight_atol


def test_accumulation_equivalence_and_every_parameter_moves(tiny_model_dir, sft_data, tmp_path):
    common = {"train.max_steps": 3, "train.max_grad_norm": "null", "data.shuffle": "false",
              "train.global_batch_size": 8}
    big = tmp_path / "b8a1"
    small = tmp_path / "b1a8"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, big, **common, **{"train.batch_size": 8})) == 0
    assert run_in_process(
        base_overrides(tiny_model_dir, sft_data, small, **common, **{"train.batch_size": 1})
    ) == 0
    assert_same_trajectory(big, small)
    a = final_weights(big)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    unmoved = [k for k in a if torch.equal(a[k], start[k])]
    assert not unmoved, f"parameters that did not move: {unmoved}"
    # The exported model loads with plain transformers.
    model = AutoModelForCausalLM.from_pretrained(big / "final")
    assert model.config.num_hidden_layers == 2
    metrics = read_jsonl(big / "metrics.jsonl")
    assert [m["step"] for m in metrics if "loss" in m] == [0, 1, 2]
    assert all(m["tokens_per_s"] > 0 and m["grad_norm"] > 0 for m in metrics if "loss" in m)


@pytest.mark.slow
def test_two_ranks_equal_one_rank(tiny_model_dir, sft_data, tmp_path):
    common = {"train.max_steps": 3, "train.max_grad_norm": "null", "data.shuffle": "false",
              "train.global_batch_size": 8}
    one = tmp_path / "one"
    two = tmp_path / "two"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, one, **common, **{"train.batch_size": 8})) == 0
    proc = run_subprocess(base_overrides(tiny_model_dir, sft_data, two, **common, **{"train.batch_size": 4}), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_trajectory(one, two)


def test_packing_trains_and_counts_rows(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "packed"
    code = run_in_process(
        base_overrides(tiny_model_dir, sft_data, out, **{"data.packing": "true", "train.max_length": 128,
                                                          "train.batch_size": 2, "train.max_steps": 3})
    )
    assert code == 0
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert len(metrics) == 3
    # A packed row of 128 tokens holds several examples: more tiers drawn than rows.
    assert sum(v for k, v in metrics[0].items() if k.startswith("tier_")) > 2


def test_tensorboard_events_and_resolved_config_are_written(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "tb"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 2,
                                                                          "metrics.tensorboard": "true"})) == 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    resolved = (out / "config.yaml").read_text()
    assert "max_steps: 2" in resolved and "spike_ratio: 10.0" in resolved  # defaults included


def test_mlp_recompute_is_a_switch_that_keeps_the_numbers(tiny_model_dir, sft_data, tmp_path, capsys):
    runs = {}
    for flag in ("false", "true"):
        out = tmp_path / flag
        assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 3,
                                                                              "train.recompute_mlp": flag})) == 0
        runs[flag] = out
    assert "'recomputed_mlps': 2" in capsys.readouterr().err  # applied through parallelize() to both blocks
    assert_same_trajectory(runs["false"], runs["true"], weight_atol=1e-6)


def test_packed_rows_train_the_same_through_varlen_attention(tiny_model_dir, sft_data, tmp_path):
    """model.attn_implementation varlen (the reference kernel on CPU) against sdpa's block-diagonal mask:
    the same packed run, step for step."""
    runs = {}
    packed = {"data.packing": "true", "train.max_length": 128, "train.batch_size": 2, "train.max_steps": 3}
    # with full checkpointing the backward recomputes each block's attention from the same boundaries
    variants = {"sdpa": {}, "varlen": {}, "varlen-ac": {"train.activation_checkpointing": "full"}}
    for name, extra in variants.items():
        runs[name] = tmp_path / name
        implementation = name.split("-")[0]
        overrides = base_overrides(tiny_model_dir, sft_data, runs[name],
                                   **packed, **extra, **{"model.attn_implementation": implementation})
        assert run_in_process(overrides) == 0
    assert_same_trajectory(runs["sdpa"], runs["varlen"])
    assert_same_trajectory(runs["sdpa"], runs["varlen-ac"])
    # the attention kernel is not part of a run's identity: a checkpoint resumes on other hardware
    configs = [resolved_config(runs[name]) for name in ("sdpa", "varlen")]
    assert configs[0]["model"]["attn_implementation"] != configs[1]["model"]["attn_implementation"]
    assert config_identity(configs[0]) == config_identity(configs[1])


def resolved_config(run_dir):
    return yaml.safe_load((run_dir / "config.yaml").read_text())
