"""The ``train:`` section's rules: one of epochs / max_steps, a global batch, no silent surprises."""

from __future__ import annotations

import pytest

from posttrain.config import ConfigError, load_config
from posttrain.config.preference import DPORecipe
from posttrain.config.recipes import PretrainRecipe, SFTRecipe

BASE = ["output_dir=runs/x", "model.path=m", "data.train=train.jsonl"]


def sft(*overrides: str) -> SFTRecipe:
    return load_config(SFTRecipe, None, [*BASE, *overrides])


def test_one_epoch_when_neither_epochs_nor_max_steps_is_set():
    assert sft().train.epochs == 1.0 and sft().train.max_steps is None
    assert sft("train.max_steps=10").train.epochs is None


def test_epochs_and_max_steps_together_are_refused():
    with pytest.raises(ConfigError, match="both set; max_steps would silently win"):
        sft("train.epochs=2", "train.max_steps=10")


def test_grad_accum_is_refused_with_the_replacement():
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        sft("train.grad_accum=4")


def test_global_batch_defaults_to_the_micro_batch():
    assert sft("train.batch_size=4").train.global_batch == 4
    assert sft("train.batch_size=4", "train.global_batch_size=32").train.global_batch == 32


def test_preference_recipes_recompute_the_mlp_by_default_and_sft_does_not():
    dpo = load_config(DPORecipe, None, BASE)
    assert dpo.train.recompute_mlp and not sft().train.recompute_mlp


def test_pretraining_always_packs_and_says_so_in_the_resolved_config():
    config = load_config(PretrainRecipe, None, BASE)
    assert config.data.packing is True
    assert config.model_dump()["data"]["packing"] is True  # what config.yaml records
    with pytest.raises(ConfigError, match="always packs"):
        load_config(PretrainRecipe, None, [*BASE, "data.packing=false"])


def test_the_old_spike_keys_say_what_replaced_them():
    with pytest.raises(ConfigError, match="set health.spike_ratio"):
        sft("health.spike_zscore=30")
    with pytest.raises(ConfigError, match="health.min_history is gone"):
        sft("health.min_history=4")


def test_no_shipped_recipe_tunes_the_health_guard():
    from pathlib import Path

    import yaml

    from posttrain.recipes import RECIPES_DIR

    for path in sorted(Path(RECIPES_DIR).glob("*.yaml")):
        health = (yaml.safe_load(path.read_text()) or {}).get("health") or {}
        assert "spike_ratio" not in health and "window" not in health, path.name
