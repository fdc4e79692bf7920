from __future__ import annotations

import pytest
import yaml

from posttrain.config import ConfigError, load_config, resolve_recipe
from posttrain.config.recipes import SFTRecipe
from posttrain.config.registry import RECIPES, register_recipe

GOOD = {
    "recipe": "sft",
    "output_dir": "runs/x",
    "model": {"path": "m"},
    "data": {"train": "train.jsonl"},
    "train": {"lr": 1e-4, "batch_size": 4},
}


def write(tmp_path, data) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def test_good_recipe_loads_with_defaults(tmp_path):
    config = load_config(SFTRecipe, write(tmp_path, GOOD))
    assert config.train.lr == 1e-4
    assert config.train.global_batch == config.train.batch_size  # global_batch_size defaults to the micro-batch
    assert config.health.spike_ratio == 10.0


def test_unknown_key_names_file_line_and_nearest_key(tmp_path):
    bad = {**GOOD, "train": {"learning_rat": 3e-4}}
    path = write(tmp_path, bad)
    with pytest.raises(ConfigError) as exc:
        load_config(SFTRecipe, path)
    message = str(exc.value)
    assert "`train.learning_rat`: unknown key; did you mean `train.lr`?" in message
    line = next(i for i, text in enumerate(open(path), 1) if "learning_rat" in text)
    assert f"{path}:{line}" in message


def test_unknown_top_level_key_suggests(tmp_path):
    with pytest.raises(ConfigError, match="did you mean `output_dir`"):
        load_config(SFTRecipe, write(tmp_path, {**GOOD, "output_dri": "x"}))


def test_wrong_type_fails_before_work(tmp_path):
    with pytest.raises(ConfigError, match=r"`train.batch_size`.*got 'eight'"):
        load_config(SFTRecipe, write(tmp_path, GOOD), ["train.batch_size=eight"])


def test_override_error_names_the_command_line(tmp_path):
    with pytest.raises(ConfigError, match=r"command line `train.max_grad_nrm=1`.*did you mean `train.max_grad_norm`"):
        load_config(SFTRecipe, write(tmp_path, GOOD), ["train.max_grad_nrm=1"])


def test_overrides_parse_numbers_and_lists(tmp_path):
    config = load_config(SFTRecipe, write(tmp_path, GOOD), ["train.lr=3e-4", "debug.nan_steps=[1, 2]"])
    assert config.train.lr == pytest.approx(3e-4)
    assert config.debug.nan_steps == [1, 2]


def test_cross_field_rule_says_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="set train.epochs or train.max_steps"):
        load_config(SFTRecipe, write(tmp_path, GOOD), ["train.epochs=null"])
    with pytest.raises(ConfigError, match="cpu_offload needs FSDP"):
        load_config(SFTRecipe, write(tmp_path, GOOD), ["train.cpu_offload=true", "train.fsdp=off"])


def test_missing_required_key(tmp_path):
    data = dict(GOOD)
    del data["model"]
    with pytest.raises(ConfigError, match="`model`: required key is missing"):
        load_config(SFTRecipe, write(tmp_path, data))


def test_resolve_recipe_dispatches_on_recipe_key(tmp_path):
    name, config = resolve_recipe(write(tmp_path, GOOD))
    assert name == "sft" and isinstance(config, SFTRecipe)
    with pytest.raises(ConfigError, match="unknown or missing recipe 'sfx'; did you mean `sft`"):
        resolve_recipe(write(tmp_path, {**GOOD, "recipe": "sfx"}))


def test_invalid_yaml_names_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("recipe: sft\nmodel: {path: [\n")
    with pytest.raises(ConfigError, match="broken.yaml:"):
        resolve_recipe(str(path))


def test_registry_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_recipe("sft", SFTRecipe, "x:y", "dup")
    assert RECIPES["sft"].schema is SFTRecipe
