"""LoRA SFT end to end on one process: only the adapters train and are checkpointed, a killed run resumes
bit for bit, the two exports agree, changed LoRA settings refuse to resume, and QLoRA runs on this CPU."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from tests.train.conftest import base_overrides, read_jsonl, run_in_process, run_subprocess

LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "train.max_steps": 6, "train.save_every": 2, "train.lr": 5e-3}
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def losses(out) -> list[float]:
    return [m["loss"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]


def checkpoint_keys(path) -> list[str]:
    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, sft_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **LORA)) == 0
    return out


def test_only_the_adapters_train_and_only_they_are_checkpointed(lora_run, tiny_model_dir, sft_data, tmp_path,
                                                                capsys):
    run_in_process(base_overrides(tiny_model_dir, sft_data, lora_run, **LORA))  # finished: says so, cheap
    keys = checkpoint_keys(lora_run / "checkpoints" / "step-000006")
    model_keys = [k for k in keys if k.startswith("model.")]
    # The optimizer (built from the parameters that require grad) holds state for the adapters alone.
    moments = [k for k in keys if k.startswith("optim.state.") and k.endswith(".exp_avg")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert sorted(k.removeprefix("optim.state.").removesuffix(".exp_avg") for k in moments) == \
        sorted(k.removeprefix("model.") for k in model_keys)
    manifest = json.loads((lora_run / "checkpoints" / "step-000006" / "manifest.json").read_text())
    assert manifest["weights"] == "trainable"

    base = load_file(f"{tiny_model_dir}/model.safetensors")
    merged = load_file(str(lora_run / "final" / "model.safetensors"))
    assert merged.keys() == base.keys()
    for name, weight in base.items():
        if any(f".{module}." in name for module in ADAPTED):
            assert not torch.equal(merged[name], weight), f"{name}: the adapter did not move it"
        else:  # embeddings, norms, the output head: frozen, and not adapted
            assert torch.equal(merged[name], weight), f"{name} changed"


def test_the_start_says_how_many_parameters_train(tiny_model_dir, sft_data, tmp_path, capsys):
    full, lora = tmp_path / "full", tmp_path / "lora"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, full, **{"train.max_steps": 1})) == 0
    assert "all trainable (full fine-tuning)" in capsys.readouterr().err
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, lora, **{**LORA, "train.max_steps": 1,
                                                                         "train.save_every": "null"})) == 0
    err = capsys.readouterr().err
    assert "M trainable (" in err and "LoRA r=4 alpha=8 on all-linear, frozen base" in err
    # A full fine-tuning checkpoint is what it always was: the whole model, no "weights" mark.
    full_keys = checkpoint_keys(full / "checkpoints" / "step-000001")
    assert "model.lm.model.embed_tokens.weight" in full_keys
    assert "weights" not in json.loads((full / "checkpoints" / "step-000001" / "manifest.json").read_text())


def test_mfu_counts_four_flops_per_frozen_weight_and_six_per_trained_one(tiny_model_dir, sft_data, tmp_path):
    """A frozen weight has no weight gradient: LoRA's base costs 4 FLOPs per value and token, not 6."""
    from transformers import AutoModelForCausalLM

    from posttrain.config.sections import LoraConfig
    from posttrain.models.lora import apply_lora
    from posttrain.train.metrics import train_flops_per_token

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    dense = sum(p.numel() for name, p in base.named_parameters() if "embed_tokens" not in name)
    assert train_flops_per_token(base) == 6 * dense
    adapted = apply_lora(base, LoraConfig(r=4, alpha=8))
    adapter = sum(p.numel() for name, p in adapted.named_parameters() if "lora_" in name)
    assert adapter > 0 and train_flops_per_token(adapted) == 6 * adapter + 4 * dense

    # The logged MFU uses it: FLOPs per token = mfu × peak ÷ tokens/s, the peak being the same on one machine.
    runs = {}
    for name, extra in (("full", {}), ("lora", {k: v for k, v in LORA.items() if k.startswith("model.lora")})):
        out = tmp_path / name
        assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{**extra, "train.max_steps": 1,
                                                                               "train.save_every": "null"})) == 0
        [record] = [r for r in read_jsonl(out / "metrics.jsonl") if "mfu" in r]
        runs[name] = record["mfu"] / record["tokens_per_s"]
    assert runs["full"] / runs["lora"] == pytest.approx(6 * dense / (6 * adapter + 4 * dense), rel=1e-9)


def test_merged_and_adapter_exports_compute_the_same_logits(lora_run, tiny_model_dir, tiny_tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(lora_run / "final", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([tiny_tokenizer("Reverse the word hello: olleh. Sort 3, 1, 2: 1, 2, 3.")["input_ids"]])
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, lora_run / "adapter").eval()
        adapter_logits = adapted(ids).logits
        merged_logits = merged(ids).logits
    assert (adapter_logits - base_logits).abs().max() > 1e-3  # the adapter matters...
    assert (merged_logits - adapter_logits).abs().max() <= 1e-5  # ...and merging it changes nothing (fp32)
    assert json.loads((lora_run / "adapter" / "adapter_config.json").read_text())["r"] == 4


def test_a_killed_lora_run_resumes_bit_exact_and_refuses_other_lora_settings(lora_run, tiny_model_dir, sft_data,
                                                                             tmp_path, capsys):
    out, other = tmp_path / "killed", tmp_path / "other"
    killed = run_subprocess(base_overrides(tiny_model_dir, sft_data, out, **{**LORA, "debug.crash_at_step": 3}))
    assert killed.returncode < 0 and (out / "checkpoints" / "step-000004").exists(), killed.stderr[-2000:]
    shutil.copytree(out, other)
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **LORA)) == 0
    assert "resuming from step 4" in capsys.readouterr().err
    assert losses(out) == losses(lora_run)
    resumed, whole = (load_file(str(run / "adapter" / "adapter_model.safetensors")) for run in (out, lora_run))
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)

    # The checkpoint holds adapters of r=4 on all-linear: another rank, or no LoRA at all, must not load it.
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, other, **{**LORA, "model.lora.r": 8})) == 2
    assert "other LoRA settings (model.lora.r 4 → 8)" in capsys.readouterr().err
    full = {k: v for k, v in LORA.items() if not k.startswith("model.lora")}
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, other, **full)) == 2
    err = capsys.readouterr().err
    assert "written by LoRA and this run is full fine-tuning" in err and "train.resume=never" in err


def test_qlora_trains_a_4bit_base_on_cpu_and_exports_full_precision(lora_run, tiny_model_dir, sft_data, tmp_path,
                                                                    capsys):
    out = tmp_path / "qlora"
    overrides = base_overrides(tiny_model_dir, sft_data, out, **{**LORA, "model.lora.quantize": "4bit"})
    assert run_in_process(overrides) == 0
    assert "4-bit NF4 base (QLoRA)" in capsys.readouterr().err
    # The 4-bit base computes other numbers than the float32 one from the first step on.
    assert losses(out)[0] != pytest.approx(losses(lora_run)[0], abs=1e-4)
    assert losses(out)[-1] < losses(out)[0]
    merged = load_file(str(out / "final" / "model.safetensors"))
    base = load_file(f"{tiny_model_dir}/model.safetensors")
    assert merged.keys() == base.keys() and all(w.dtype == torch.float32 for w in merged.values())
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    # FSDP2 cannot shard the packed 4-bit weights: refused in one line, before training.
    assert run_in_process([*overrides, f"output_dir={tmp_path / 'sharded'}", "train.fsdp=on"]) == 2
    assert "model.lora.quantize=4bit runs in one process" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["sft_lora_tiny", "dpo_lora_tiny"])
def test_the_packaged_lora_recipes_train(recipe, tiny_model_dir, sft_data, tmp_path):
    from posttrain.cli import main
    from posttrain.config import resolve_recipe
    from tests.train_preference.conftest import preference_rows, write_jsonl

    kind, config = resolve_recipe(recipe)
    assert config.model.lora is not None and config.model.lora.quantize == "none"
    if kind == "dpo":
        data = [f"data.train={write_jsonl(tmp_path / 'pairs.jsonl', preference_rows(16, seed=0))}", "data.eval=null",
                f"dpo.reference_cache_dir={tmp_path / 'cache'}", "dpo.min_pairs=16"]  # few pairs on purpose
    else:
        data = [f"data.train={sft_data}"]
    out = tmp_path / "run"
    overrides = [f"model.path={tiny_model_dir}", f"output_dir={out}", "train.max_steps=2", "train.max_length=64",
                 "metrics.tensorboard=false", *data]
    assert main([kind, "--config", recipe, *overrides]) == 0
    assert (out / "final" / "model.safetensors").exists() and (out / "adapter" / "adapter_config.json").exists()
