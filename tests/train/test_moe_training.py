"""Mixture-of-experts training: router losses keep the accumulation equivalence, every packaged recipe trains a
tiny MoE, expert load reaches metrics.jsonl, and model.moe on a dense model is a config error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main
from tests.rl.conftest import grpo_overrides, rl_data  # noqa: F401 - rl_data is a fixture used below
from tests.train.conftest import base_overrides, read_jsonl, run_in_process, run_subprocess
from tests.train.test_sft_equivalence import assert_same_trajectory
from tests.train_preference.conftest import dpo_overrides, preference_rows, rm_overrides, write_jsonl

EXPERTS, TOP_K = 4, 2  # the tiny_moe_dir fixture's shape


def _steps(out):
    return [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]


def _biases(out) -> dict:
    return {k: v for k, v in load_file(str(out / "final" / "model.safetensors")).items() if "correction_bias" in k}


@pytest.mark.parametrize(("arch", "moe"), [
    ("qwen3_moe", {"model.moe.aux_loss_weight": 0.1, "model.moe.z_loss_weight": 0.01}),
    ("deepseek_v3", {"model.moe.aux_loss_weight": 0.1, "model.moe.bias_update_rate": 0.01}),
])
def test_router_losses_keep_accumulation_equivalence(arch, moe, tiny_moe_dir, sft_data, tmp_path):
    """1 micro-batch of 4 == 4 micro-batches of 1 with the router losses on: the per-sequence losses are token
    sums divided by the step's token count, and the bias update reads the whole step's load."""
    model = tiny_moe_dir(arch)
    common = {"train.max_steps": 2, "train.max_grad_norm": "null", "data.shuffle": "false",
              "train.global_batch_size": 4, "train.lr_schedule": "constant"}
    runs = {}
    # b1a4 also recomputes every block in backward: the routing is read once, in the forward, all the same
    checkpointed = {"train.activation_checkpointing": "full"}
    for name, extra in {"b4a1": {"train.batch_size": 4, **moe}, "b1a4": {"train.batch_size": 1, **moe, **checkpointed},
                        "plain": {"train.batch_size": 4}}.items():
        runs[name] = tmp_path / name
        assert run_in_process(base_overrides(model, sft_data, runs[name], **common, **extra)) == 0
    assert_same_trajectory(runs["b4a1"], runs["b1a4"])
    big, small, plain = (_steps(runs[name]) for name in ("b4a1", "b1a4", "plain"))
    for x, y in zip(big, small, strict=True):
        moe_keys = {k for k in x if k.startswith("moe/")}
        assert moe_keys == {k for k in y if k.startswith("moe/")} and "moe/aux_loss" in moe_keys
        for key in moe_keys:
            assert x[key] == pytest.approx(y[key], rel=1e-5), key
    # The logged loss is the task loss alone (as a dense run's); the router losses reach the gradient only.
    assert big[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert big[0]["grad_norm"] != pytest.approx(plain[0]["grad_norm"], rel=1e-4)
    assert "moe/aux_loss" not in plain[0] and "moe/layer1/load_entropy" in plain[0]  # load is logged regardless
    if arch == "qwen3_moe":  # the report's per-layer heat map, drawn from metrics.jsonl
        from posttrain.report import write_report

        written = write_report(runs["b4a1"])
        assert 'id="chart-' in (html := open(written["html"]).read()) and "expert-load" in html
        assert "expert load per MoE layer" in html
    if arch == "deepseek_v3":
        biases, again = _biases(runs["b4a1"]), _biases(runs["b1a4"])
        assert biases.keys() == again.keys() and all((biases[k] == again[k]).all() for k in biases)
        assert all(b.abs().max() > 0 for b in biases.values()), "the selection bias never moved"
        assert all((b.abs() <= 2 * 0.01 + 1e-7).all() for b in biases.values())  # ≤ rate per update, 2 updates


@pytest.mark.slow
def test_router_losses_keep_two_ranks_equal_to_one(tiny_moe_dir, sft_data, tmp_path):
    """The router losses' normaliser is global: 2 ranks × 2 == 1 rank × 4, bias update included (the load is
    all-reduced with the loss, so both ranks move their copy of every bias alike)."""
    model = tiny_moe_dir("deepseek_v3")
    common = {"train.max_steps": 2, "train.max_grad_norm": "null", "data.shuffle": "false",
              "train.global_batch_size": 4, "train.lr_schedule": "constant", "model.moe.aux_loss_weight": 0.1,
              "model.moe.z_loss_weight": 0.01, "model.moe.bias_update_rate": 0.01}
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_in_process(base_overrides(model, sft_data, one, **common, **{"train.batch_size": 4})) == 0
    proc = run_subprocess(base_overrides(model, sft_data, two, **common, **{"train.batch_size": 2}), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_trajectory(one, two)
    for x, y in zip(_steps(one), _steps(two), strict=True):
        assert {k: v for k, v in x.items() if k.startswith("moe/")} == pytest.approx(
            {k: v for k, v in y.items() if k.startswith("moe/")}, rel=1e-5)
    biases, again = _biases(one), _biases(two)
    assert all(torch.equal(biases[k], again[k]) for k in biases) and biases


def test_model_moe_on_a_dense_model_is_a_config_error(tiny_model_dir, sft_data, tmp_path, capsys):
    out = tmp_path / "dense"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{"model.moe.aux_loss_weight": 0.01})) == 2
    err = capsys.readouterr().err
    assert "model.moe is set but" in err and "dense llama model" in err
    assert not out.exists()  # refused before any run state was written


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, str]:
    return {"train": str(write_jsonl(tmp_path_factory.mktemp("pairs") / "train.jsonl", preference_rows(24, seed=1)))}


RECIPES = [  # (packaged recipe, command, architecture): each MoE family through at least two recipes
    ("sft_tiny", "sft", "qwen3_moe"),
    ("dpo_tiny", "dpo", "deepseek_v3"),
    ("rm_tiny", "rm", "qwen3_moe"),
    ("grpo_tiny", "grpo", "deepseek_v3"),
    ("sft_lora_tiny", "sft", "qwen3_moe"),
]


@pytest.mark.parametrize(("recipe", "command", "arch"), RECIPES, ids=[r[0] for r in RECIPES])
def test_every_packaged_recipe_trains_a_tiny_moe(recipe, command, arch, tiny_moe_dir, sft_data, pairs,
                                                  rl_data, tmp_path):  # noqa: F811 - rl_data: the imported fixture
    model, out = tiny_moe_dir(arch), tmp_path / recipe
    moe = {"model.moe.aux_loss_weight": 0.01, "model.moe.z_loss_weight": 0.001}
    if arch == "deepseek_v3":
        moe["model.moe.bias_update_rate"] = 0.001
    short = {"train.max_steps": 2, **moe}
    if command == "sft":
        overrides = base_overrides(model, sft_data, out, **short)
    elif command == "dpo":
        overrides = dpo_overrides(model, pairs, out, **short, **{"train.batch_size": 4, "data.eval": "null"})
    elif command == "rm":
        overrides = rm_overrides(model, pairs, out, **short, **{"train.batch_size": 4})
    else:  # every completion forwarded, so the token check below is exact (see docs/moe.md on skipped ones)
        overrides = grpo_overrides(model, rl_data, out, **short, **{"rl.skip_zero_advantage": "false"})
    assert main([command, "--config", recipe, *overrides]) == 0
    steps = _steps(out)
    assert [m["step"] for m in steps] == [0, 1]
    layers = [1] if arch == "deepseek_v3" else [0, 1]
    for record in steps:
        assert {f"moe/layer{i}/load_max" for i in layers} <= record.keys() and record["moe/aux_loss"] > 0
        # The router losses' normaliser (the source's token count) is what the routers saw: K choices per
        # real token spread over E experts.
        tokens = record["tokens_per_s"] * record["step_time_s"]
        assert record[f"moe/layer{layers[0]}/load_mean"] * EXPERTS / TOP_K == pytest.approx(tokens, rel=1e-6)
    if recipe == "sft_lora_tiny":  # adapters on the attention projections; the stacked experts stay frozen
        targets = set(json.loads((out / "adapter" / "adapter_config.json").read_text())["target_modules"])
        assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= targets and not any("expert" in t for t in targets)


def test_expert_load_reaches_prometheus_by_layer():
    from prometheus_client import generate_latest

    from posttrain.telemetry.prometheus import PrometheusExporter

    exporter = PrometheusExporter(0, "127.0.0.1")
    try:
        exporter.observe({"step": 3, "loss": 1.0, "moe/layer0/load_max": 30.0, "moe/layer0/load_mean": 20.0,
                          "moe/layer0/load_entropy": 0.9, "moe/layer1/load_max": 20.0, "moe/layer1/load_mean": 20.0,
                          "moe/layer1/load_entropy": 1.0, "moe/aux_loss": 2.1})
        text = generate_latest(exporter.registry).decode()
    finally:
        exporter.close()
    assert 'posttrain_moe_expert_load_ratio{layer="0"} 1.5' in text
    assert 'posttrain_moe_expert_load_ratio{layer="1"} 1.0' in text
    assert 'posttrain_moe_expert_load_entropy{layer="0"} 0.9' in text
    assert "posttrain_moe_aux_loss 2.1" in text
