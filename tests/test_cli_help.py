"""Every recipe's ``--help`` lists every key of its schema, with type, default and description; the parser built for
one command (``build_parser(command)``) holds that command exactly as the full parser does."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import types
import typing

import pytest
from pydantic import BaseModel

from posttrain.cli import RECIPE_MODULES, TOOL_COMMANDS, build_parser, command_of, main
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


def _subcommands(parser) -> dict:
    """Every subcommand parser below ``parser``, by its words (``("data", "inspect")``)."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found[(name,)] = child
                found.update({(name, *words): grandchild for words, grandchild in _subcommands(child).items()})
    return found


def test_each_tool_module_registers_exactly_the_command_the_table_names():
    for name, module_name in TOOL_COMMANDS.items():
        subparsers = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module_name).register(subparsers)
        assert list(subparsers.choices) == [name], module_name


def test_each_recipe_is_registered_by_the_module_the_table_names():
    # In a fresh interpreter per module: importing it alone must register its recipes (here, everything is loaded).
    assert set(RECIPE_MODULES) == set(RECIPES)
    for module_name in sorted(set(RECIPE_MODULES.values())):
        probe = (f"import {module_name}; from posttrain.config.registry import RECIPES; "
                 f"print(' '.join(sorted(RECIPES)))")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        names = {name for name, module in RECIPE_MODULES.items() if module == module_name}
        assert names <= set(out.stdout.split()), (module_name, out.stdout)


def test_the_parser_built_for_one_command_has_that_command_as_the_full_parser_has_it():
    full = _subcommands(build_parser())
    assert set(full) >= {(name,) for name in [*TOOL_COMMANDS, *RECIPES]}
    for (name,) in [words for words in full if len(words) == 1]:
        alone = _subcommands(build_parser(name))
        assert {words[0] for words in alone} == {name}  # nothing else was built
        for words, parser in alone.items():
            assert parser.format_help() == full[words].format_help(), words
            assert parser.format_usage() == full[words].format_usage(), words


@pytest.mark.parametrize(("argv", "command"), [
    (["curate", "--config", "curate"], "curate"), (["--debug", "data", "inspect"], "data"), (["--help"], None),
    (["--deb", "sft"], None), ([], None), (["-h", "curate"], None), (["--version"], None), (["nosuch"], "nosuch"),
])
def test_the_command_is_told_only_from_a_leading_word(argv, command):
    assert command_of(argv) == command


def test_an_unknown_command_is_refused_with_every_choice_listed(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["nosuch"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nosuch'" in err
    assert all(f"'{name}'" in err for name in [*TOOL_COMMANDS, *RECIPES])


def test_a_recipe_command_imports_no_other_command_or_recipe_module(tmp_path):
    # `posttrain curate` must not pay for the other commands' modules or the training recipes' schemas.
    probe = ("import sys; from posttrain.cli import build_parser, RECIPE_MODULES, TOOL_COMMANDS; "
             "build_parser('curate'); print(sorted(m for m in [*TOOL_COMMANDS.values(), *RECIPE_MODULES.values()] "
             "if m in sys.modules and m != 'posttrain.curate.config'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "[]", out.stdout
