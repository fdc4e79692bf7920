"""LoRA on a mixture of experts: ``model.lora.experts`` adapts the routed experts' stacked weights (they train, the
base does not move, both exports compute the same logits, a killed run resumes bit for bit, the start line counts
them); ``all-linear`` alone adapts the attention and leaves experts and router frozen, with no peft warning; the
switch is refused on a dense model, with expert parallelism and with dropout."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file

from tests.rl.conftest import grpo_overrides, rl_data  # noqa: F401 - rl_data is a fixture used below
from tests.train.conftest import base_overrides, read_jsonl, run_in_process, run_subprocess
from tests.train.test_lora import checkpoint_keys

EXPERTS = {"model.lora.r": 4, "model.lora.alpha": 8, "model.lora.experts": "true", "train.max_steps": 4,
           "train.save_every": 2, "train.lr": 5e-3}
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def losses(out) -> list[float]:
    return [m["loss"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]


def _lm(path):
    from posttrain.models.load import load_model

    return load_model(path, "float32")


def _lora(**settings):
    from posttrain.config.sections import LoraConfig

    return LoraConfig(**{"r": 4, "alpha": 8, **settings})


def _ids(tokenizer_dir) -> torch.Tensor:
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    return torch.tensor([tokenizer("Reverse the word hello: olleh. Sort 3, 1, 2: 1, 2, 3.")["input_ids"]])


@pytest.fixture(scope="module")
def experts_run(tiny_moe_dir, sft_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-experts") / "run"
    assert run_in_process(base_overrides(tiny_moe_dir("qwen3_moe"), sft_data, out, **EXPERTS)) == 0
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_expert_adapters_train_and_the_base_experts_do_not_move(arch, tiny_moe_dir):
    """One optimizer step: every expert adapter gets a gradient and moves; no base weight gets one (the stacked
    experts and the router included); the count says attention adapters + r·E·(in + out) per expert weight."""
    from posttrain.models.lora import apply_lora, parameter_counts
    from posttrain.train.expert_parallel import experts_modules

    lm = _lm(tiny_moe_dir(arch))
    stacks = {name: p.detach().clone() for name, p in lm.named_parameters() if name.endswith(EXPERT_WEIGHTS)}
    per_expert_weight = sum(4 * w.shape[0] * (w.shape[1] + w.shape[2]) for w in stacks.values())  # r·E·(in+out)
    attention = apply_lora(_lm(tiny_moe_dir(arch)), _lora())
    model = apply_lora(lm, _lora(experts=True))
    assert len(experts_modules(lm)) == (2 if arch == "qwen3_moe" else 1) and stacks
    trainable, _ = parameter_counts(model)
    assert trainable == parameter_counts(attention)[0] + per_expert_weight

    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    expert_adapters = {name for name in trained if ".mlp.experts." in name}
    assert expert_adapters and all(".lora_A." in n or ".lora_B." in n for n in trained)
    before = {name: p.detach().clone() for name, p in trained.items()}
    optimizer = torch.optim.AdamW(trained.values(), lr=1e-2)
    for _ in range(2):  # B starts at zero, so A's gradient does too: the second step moves both
        ids = torch.randint(5, 300, (2, 12))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(not torch.equal(before[name], trained[name]) for name in expert_adapters)
    frozen = {name: p for name, p in model.named_parameters() if not p.requires_grad}
    assert all(p.grad is None for p in frozen.values())
    unwrapped = {name.replace("base_layer.", ""): p for name, p in frozen.items()}  # peft nests its wrappers
    now = {name: p for name, p in unwrapped.items() if name.endswith(EXPERT_WEIGHTS)}
    assert len(now) == len(stacks)
    for name, weight in stacks.items():
        assert torch.equal(now[f"base_model.model.{name}"], weight), name
    # With the adapters off (DPO's reference, GRPO's KL term) the model is the base again, experts included.
    from posttrain.models.lora import adapter_disabled

    ids = torch.randint(5, 300, (1, 12))
    with torch.no_grad():
        base_logits = _lm(tiny_moe_dir(arch))(input_ids=ids).logits
        with adapter_disabled(model):
            off = model(input_ids=ids).logits
        assert (model(input_ids=ids).logits - base_logits).abs().max() > 1e-4
    assert torch.allclose(off, base_logits, atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_all_linear_on_a_moe_adapts_the_attention_only_and_peft_warns_nothing(arch, tiny_moe_dir, tmp_path):
    """peft's transformers-4 rewrite turned all-linear on these models into adapters on the experts (at rank 2r for
    gate_up_proj, hence its "rank_pattern keys did not match" warning) and the router; posttrain's config is a fixed
    point of it, so nothing but the attention is adapted, and the saved adapter loads back the same."""
    from peft import PeftModel

    from posttrain.models.lora import apply_lora

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # peft's rank_pattern / alpha_pattern warnings
        model = apply_lora(_lm(tiny_moe_dir(arch)), _lora())
    config = model.peft_config["default"]
    assert not config.target_parameters and not config.rank_pattern and not config.alpha_pattern
    adapted = {name.split(".lora_")[0] for name, p in model.named_parameters() if p.requires_grad}
    assert adapted and all(".self_attn." in name for name in adapted), sorted(adapted)
    model.save_pretrained(tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        again = PeftModel.from_pretrained(_lm(tiny_moe_dir(arch)), tmp_path / "adapter")
    assert {name.split(".lora_")[0] for name, _ in again.named_parameters() if ".lora_" in name} == adapted


def test_naming_the_experts_old_linear_layers_is_refused(tiny_moe_dir):
    from posttrain.models.lora import LoraSetupError, apply_lora

    with pytest.raises(LoraSetupError, match=r"reads \['down_proj'\] as transformers-4 names .*model.lora.experts"):
        apply_lora(_lm(tiny_moe_dir("qwen3_moe")), _lora(target_modules=["q_proj", "down_proj"]))


def test_expert_adapters_are_checkpointed_and_exported(experts_run, tiny_moe_dir):
    keys = checkpoint_keys(experts_run / "checkpoints" / "step-000004")
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert any(".mlp.experts." in k for k in model_keys)  # the expert adapters, and their moments beside them
    assert any(k.startswith("optim.state.") and ".mlp.experts." in k for k in keys)

    adapter = load_file(str(experts_run / "adapter" / "adapter_model.safetensors"))
    expert_b = [v for k, v in adapter.items() if ".mlp.experts." in k and ".lora_B." in k]
    assert len(expert_b) == 4 and all(v.abs().max() > 0 for v in expert_b)  # 2 layers × 2 weights, moved from 0
    config = json.loads((experts_run / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    assert config["rank_pattern"] == {} and config["lora_dropout"] == 0

    # (transformers writes the experts one by one, mlp.experts.<i>.{gate,up,down}_proj.weight, as its v4 layout)
    base = load_file(f"{tiny_moe_dir('qwen3_moe')}/model.safetensors")
    merged = load_file(str(experts_run / "final" / "model.safetensors"))
    assert merged.keys() == base.keys() and any(".mlp.experts.3.up_proj." in name for name in base)
    for name, weight in base.items():
        if ".mlp.experts." in name or ".self_attn." in name and name.endswith("proj.weight"):
            assert not torch.equal(merged[name], weight), f"{name}: the adapter did not move it"
        else:  # embeddings, norms, the router, the output head
            assert torch.equal(merged[name], weight), f"{name} changed"


def test_merged_and_adapter_exports_compute_the_same_logits(experts_run, tiny_moe_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tiny_moe_dir("qwen3_moe")
    ids = _ids(path)
    merged = AutoModelForCausalLM.from_pretrained(experts_run / "final", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        adapter_logits = PeftModel.from_pretrained(base, experts_run / "adapter").eval()(ids).logits
        merged_logits = merged(ids).logits
        # the expert adapters matter on their own: the merged model with its experts put back computes otherwise
        original = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
        for name, param in merged.named_parameters():
            if name.endswith(EXPERT_WEIGHTS):
                param.copy_(original[name])
        without_experts = merged(ids).logits
    assert (adapter_logits - base_logits).abs().max() > 1e-3
    assert (merged_logits - adapter_logits).abs().max() <= 1e-5  # fp32
    assert (without_experts - merged_logits).abs().max() > 1e-4


def test_the_start_line_counts_the_expert_adapters(tiny_moe_dir, sft_data, tmp_path, capsys):
    from posttrain.models.lora import apply_lora, parameter_counts

    path = tiny_moe_dir("qwen3_moe")
    trainable, total = parameter_counts(apply_lora(_lm(path), _lora(experts=True)))
    one_step = {**EXPERTS, "train.max_steps": 1, "train.save_every": "null"}
    assert run_in_process(base_overrides(path, sft_data, tmp_path / "run", **one_step)) == 0
    err = capsys.readouterr().err
    assert f"{total / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable ({100 * trainable / total:.2f}%)" in err
    assert "LoRA r=4 alpha=8 on all-linear (k_proj, o_proj, q_proj, v_proj) and the routed experts" in err


def test_a_killed_expert_lora_run_resumes_bit_exact(experts_run, tiny_moe_dir, sft_data, tmp_path, capsys):
    path, out = tiny_moe_dir("qwen3_moe"), tmp_path / "killed"
    killed = run_subprocess(base_overrides(path, sft_data, out, **{**EXPERTS, "debug.crash_at_step": 3}))
    assert killed.returncode < 0 and (out / "checkpoints" / "step-000002").exists(), killed.stderr[-2000:]
    assert not (out / "checkpoints" / "step-000004").exists()
    other = tmp_path / "other"
    shutil.copytree(out, other)
    assert run_in_process(base_overrides(path, sft_data, out, **EXPERTS)) == 0
    assert "resuming from step 2" in capsys.readouterr().err
    assert losses(out) == losses(experts_run)
    resumed, whole = (load_file(str(run / "adapter" / "adapter_model.safetensors")) for run in (out, experts_run))
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)
    # Its checkpoint holds expert adapters: a resume without them is refused (they are part of the run identity).
    assert run_in_process(base_overrides(path, sft_data, other, **{**EXPERTS, "model.lora.experts": "false"})) == 2
    assert "model.lora.experts" in capsys.readouterr().err


def test_expert_adapters_on_a_dense_model_are_a_config_error(tiny_model_dir, sft_data, tmp_path, capsys):
    out = tmp_path / "dense"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **EXPERTS)) == 2
    err = capsys.readouterr().err
    assert "model.lora.experts is set but" in err and "dense llama model" in err
    assert not out.exists()  # refused before any run state was written


def test_expert_adapters_with_expert_parallelism_are_a_config_error(tiny_moe_dir, sft_data, tmp_path, capsys):
    """peft's expert adapter is one update for all E experts; EP keeps E / N of them per rank (DTensor shards)."""
    out = tmp_path / "ep"
    args = base_overrides(tiny_moe_dir("qwen3_moe"), sft_data, out, **{**EXPERTS, "parallel.expert": 2})
    assert run_in_process(args) == 2
    err = capsys.readouterr().err
    assert "model.lora.experts with parallel.expert=2" in err and "parallel.expert=1" in err
    assert not out.exists()


def test_expert_adapters_with_the_vllm_rollout_engine_are_a_config_error(tiny_moe_dir, rl_data, tmp_path,  # noqa: F811
                                                                        capsys):
    """posttrain's weight sync hands vLLM linear adapters merged (W + s·B·A), not peft's expert wrappers."""
    from posttrain.cli import main

    out = tmp_path / "vllm"
    args = grpo_overrides(tiny_moe_dir("qwen3_moe"), rl_data, out, **{"model.lora.r": 4, "model.lora.experts": "true",
                                                                       "rollout.engine": "vllm"})
    assert main(["grpo", "--config", "grpo_tiny", *args]) == 2
    assert "not model.lora.experts' expert adapters: use rollout.engine=hf" in capsys.readouterr().err
    assert not out.exists()


def test_the_switch_is_typed_off_by_default_and_refuses_dropout():
    from pydantic import ValidationError

    assert _lora().experts is False
    with pytest.raises(ValidationError, match="model.lora.experts needs model.lora.dropout=0"):
        _lora(experts=True, dropout=0.1)
    with pytest.raises(ValidationError, match="experts"):
        _lora(experts="maybe")


@pytest.mark.slow
def test_expert_adapters_on_two_fsdp_ranks_equal_one(tiny_moe_dir, sft_data, tmp_path):
    """parallel.expert=1: FSDP2 shards the expert adapters with their block; 2 ranks × 2 == 1 rank × 4."""
    path, one, two = tiny_moe_dir("qwen3_moe"), tmp_path / "one", tmp_path / "two"
    common = {**EXPERTS, "train.max_steps": 2, "train.save_every": "null", "train.global_batch_size": 4,
              "data.shuffle": "false", "train.lr_schedule": "constant", "train.max_grad_norm": "null"}
    assert run_in_process(base_overrides(path, sft_data, one, **common, **{"train.batch_size": 4})) == 0
    proc = run_subprocess(base_overrides(path, sft_data, two, **common, **{"train.batch_size": 2}), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(one) == pytest.approx(losses(two), rel=1e-5)
    a, b = (load_file(str(run / "adapter" / "adapter_model.safetensors")) for run in (one, two))
    assert a.keys() == b.keys() and any(".mlp.experts." in k for k in a)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.slow
def test_attention_lora_runs_with_expert_parallelism(tiny_moe_dir, sft_data, tmp_path):
    """Without model.lora.experts the stacked experts are not wrapped by peft, so EP can shard them (peft's
    all-linear rewrite used to wrap them, and EP then failed mixing a Tensor update with the DTensor shards)."""
    out = tmp_path / "ep"
    settings = {**EXPERTS, "model.lora.experts": "false", "train.max_steps": 2, "train.save_every": "null",
                "train.global_batch_size": 4, "train.batch_size": 2, "parallel.expert": 2}
    proc = run_subprocess(base_overrides(tiny_moe_dir("qwen3_moe"), sft_data, out, **settings), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(losses(out)) == 2 and (out / "adapter" / "adapter_model.safetensors").exists()
