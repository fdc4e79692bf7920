"""posttrain.models.lora: the config section, what trains, the frozen base, and the one-line errors."""

from __future__ import annotations

import sys

import pytest
import torch

from posttrain.config import load_config
from posttrain.config.loader import ConfigError
from posttrain.config.recipes import SFTRecipe
from posttrain.config.sections import LoraConfig
from posttrain.models.load import load_model
from posttrain.models.logprobs import TokenLogprobModel
from posttrain.models.lora import (
    LoraSetupError,
    adapter_disabled,
    apply_lora,
    check_4bit_support,
    describe,
    parameter_counts,
)

ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_the_section_is_typed_and_off_by_default():
    config = load_config(SFTRecipe, "sft_tiny")
    assert config.model.lora is None  # full fine-tuning unless asked
    config = load_config(SFTRecipe, "sft_tiny", ["model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj]"])
    assert config.model.lora == LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="did you mean `model.lora.alpha`"):
        load_config(SFTRecipe, "sft_tiny", ["model.lora.alhpa=4"])
    with pytest.raises(ConfigError, match="model.lora.quantize"):
        load_config(SFTRecipe, "sft_tiny", ["model.lora.quantize=8bit"])
    with pytest.raises(ConfigError, match="target_modules is empty"):
        load_config(SFTRecipe, "sft_tiny", ["model.lora.target_modules=[]"])


def test_only_the_adapters_train_and_the_count_says_how_many(tiny_model_dir):
    lm = apply_lora(load_model(tiny_model_dir), LoraConfig(r=4, alpha=8))
    trainable = {name for name, p in lm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: every projection of every block, never the embeddings or the output head.
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[1] for name in trainable}
    assert adapted == set(ADAPTED)
    layers = lm.config.num_hidden_layers
    hidden, inter = lm.config.hidden_size, lm.config.intermediate_size
    kv = lm.config.num_key_value_heads * (hidden // lm.config.num_attention_heads)
    # r × (in + out) per adapted matrix, by hand: q, o: (h + h); k, v: (h + kv); gate, up: (h + i); down: (i + h).
    per_layer = 4 * (2 * (2 * hidden) + 2 * (hidden + kv) + 3 * (hidden + inter))
    assert parameter_counts(lm) == (layers * per_layer, sum(p.numel() for p in lm.parameters()))
    line = describe(LoraConfig(r=4, alpha=8), *parameter_counts(lm))
    assert f"{layers * per_layer / 1e6:.3f}M trainable" in line and "frozen base" in line


def test_adapter_disabled_is_the_frozen_base(tiny_model_dir, tiny_tokenizer):
    base = TokenLogprobModel(load_model(tiny_model_dir))
    lm = apply_lora(load_model(tiny_model_dir), LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if ".lora_B." in name:  # B starts at zero (step 0 is the base); move it so the adapter matters
                param.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    root = TokenLogprobModel(lm)
    ids = torch.tensor([tiny_tokenizer("What is 12 plus 30? The answer is 42.")["input_ids"]])
    with torch.no_grad():
        expected, _ = base(ids, ids)
        adapted, _ = root(ids, ids)
        with adapter_disabled(root):
            disabled, _ = root(ids, ids)
        again, _ = root(ids, ids)
    assert not torch.allclose(adapted, expected, atol=1e-3)  # the adapter changes the numbers
    assert torch.equal(disabled, expected)  # ...and switched off, it is exactly the base
    assert torch.equal(again, adapted)  # switched back on afterwards


def test_unknown_target_modules_fail_in_one_line(tiny_model_dir):
    with pytest.raises(LoraSetupError, match=r"model.lora.target_modules=\['qproj'\]"):
        apply_lora(load_model(tiny_model_dir), LoraConfig(target_modules=["qproj"]))


def test_4bit_without_bitsandbytes_or_on_an_unsupported_device_fails_in_one_line(monkeypatch):
    # A device no bitsandbytes backend serves: the probe round trip fails, and says so in one line.
    with pytest.raises(LoraSetupError, match="cannot quantise to 4 bits on meta") as caught:
        check_4bit_support("meta")
    assert "\n" not in str(caught.value) and "model.lora.quantize=none" in str(caught.value)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "bitsandbytes.functional", raising=False)
    with pytest.raises(LoraSetupError, match=r"pip install 'posttrain\[qlora\]'"):
        check_4bit_support("cpu")


def test_bitsandbytes_quantises_to_4_bits_on_this_cpu():
    # What QLoRA on CPU rests on (bitsandbytes >= 0.49 has a CPU backend); the SFT run is tests/train/test_lora.py.
    check_4bit_support("cpu")
