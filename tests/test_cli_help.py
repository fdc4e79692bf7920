"""Every recipe's ``--help`` lists every key of its schema, with type, default and description."""

from __future__ import annotations

import types
import typing

import pytest
from pydantic import BaseModel

from posttrain.cli import build_parser
from posttrain.config.keys import config_keys, format_config_keys, type_name
from posttrain.config.registry import RECIPES, load_builtin_recipes
from posttrain.flywheel.config import FlywheelRecipe

load_builtin_recipes()


def _subparser(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def _section(annotation) -> type[BaseModel] | None:
    """The model a field nests (``Foo`` or ``Foo | None``), found independently of posttrain.config.keys."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def all_dotted_keys(schema: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    keys = []
    for name, field in schema.model_fields.items():
        section = _section(field.annotation)
        if section is None:
            keys.append((prefix + name, field))
        else:
            keys.extend(all_dotted_keys(section, f"{prefix}{name}."))
    return keys


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_help_lists_every_field_with_type_and_description(name):
    schema = RECIPES[name].schema
    text = _subparser(name).format_help()
    flat = " ".join(text.split())  # descriptions are wrapped over lines
    keys = all_dotted_keys(schema)
    assert len(keys) >= 5
    missing = [key for key, _ in keys if f" {key} (" not in flat]
    assert not missing, f"`posttrain {name} --help` does not list {missing}"
    for key, field in keys:
        entry = flat[flat.index(f" {key} (") + 1:]
        assert entry.startswith(f"{key} ({type_name(field.annotation)}, "), entry[:120]
        if field.description:
            assert " ".join(field.description.split())[:40] in entry.split(f"{key} (", 1)[1][:600], key


def test_sft_help_shows_defaults_as_written_in_yaml():
    text = " ".join(_subparser("sft").format_help().split())
    assert "train.lr (float, default 2e-05)" in text
    assert "model.path (str, required): Local HF-format directory" in text
    assert "data.packing (bool, default false)" in text
    assert "train.max_steps (int | None, default null): " in text
    assert "train.lr_schedule (constant|linear|cosine, default cosine)" in text
    assert "train.betas (tuple[float, float], default [0.9, 0.95])" in text


def test_a_section_built_by_a_factory_shows_that_instance_defaults():
    # The sampler's judge is JudgeConfig(min_score=None), unlike the curate judge (min_score 2).
    sample = {k.key: k.default for k in config_keys(RECIPES["sample"].schema)}
    curate = {k.key: k.default for k in config_keys(RECIPES["curate"].schema)}
    assert sample["scorer.judge.min_score"] is None
    assert curate["judge.min_score"] == RECIPES["curate"].schema.model_fields["judge"].annotation().min_score
    assert curate["judge.min_score"] is not None


def test_optional_section_is_listed_with_its_keys():
    text = " ".join(format_config_keys(RECIPES["curate"].schema).split())
    assert "difficulty.ifd (IFDConfig | None, default null)" in text
    assert "difficulty.ifd.model (str, required)" in text


def test_quickstart_help_lists_the_flywheel_keys():
    text = " ".join(_subparser("quickstart").format_help().split())
    for key, _ in all_dotted_keys(FlywheelRecipe):
        assert f" {key} (" in text, key
