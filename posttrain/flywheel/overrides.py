"""A flywheel stage's ``overrides``: keys of another recipe, merged key by key over that recipe's YAML.

One spelling on the inside: dotted keys (``train.lr``). A YAML mapping written nested (``train: {lr: 1e-3}``)
and a command-line override such as ``sft.overrides.train.max_steps=200`` (which the loader sets as
``{"train": {"max_steps": 200}}`` inside ``overrides``) are flattened to the same dotted keys. Passed on to
the stage whole, a nested ``train: {max_steps: 200}`` would replace the recipe's ``train`` section and
silently train with the defaults of every other key (issue 25).

Each key is checked against the schema of the recipe the stage runs, so a misspelt one stops the config
load (exit 2) naming the nearest valid key, before any stage has run.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel

from posttrain.config.loader import ConfigError, load_config, nearest_keys


def flatten_overrides(value: Any) -> Any:
    """``{"train": {"lr": 1}, "data.packing": True}`` → ``{"train.lr": 1, "data.packing": True}``.

    Later keys win where two spellings name the same key (a command-line override lands after the file's
    keys). An empty mapping stays a value (``x: {}`` sets ``x`` to an empty mapping). Anything but a mapping
    is returned unchanged for pydantic to reject with its usual message."""
    if not isinstance(value, dict):
        return value
    flat: dict[str, Any] = {}

    def walk(prefix: str, item: Any) -> None:
        if isinstance(item, dict) and item:
            for key, child in item.items():
                walk(f"{prefix}.{key}" if prefix else str(key), child)
        else:
            flat.pop(prefix, None)  # re-inserted last: the latest spelling is the one that counts
            flat[prefix] = item

    for key, item in value.items():
        walk(str(key), item)
    return flat


def _section(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds (``Foo`` or ``Foo | None``); None for a plain value, a list or a
    free mapping, whose inner keys no schema names."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(models) == 1 and isinstance(models[0], type) and issubclass(models[0], BaseModel):
            return models[0]
    return None


def unknown_keys(schema: type[BaseModel], overrides: dict[str, Any], what: str = "the recipe") -> list[str]:
    """One problem per dotted key of ``overrides`` that ``schema`` (``what``) does not have, naming the nearest key."""
    problems = []
    for key in overrides:
        model: type[BaseModel] | None = schema
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if model is None:
                break  # below a plain field (a mapping such as debug.nan_steps): the recipe checks the value
            if part not in model.model_fields:
                valid = sorted(model.model_fields)
                guess = nearest_keys(part, valid)
                section = ".".join(parts[:depth])
                hint = (f"did you mean `{'.'.join([*parts[:depth], guess[0], *parts[depth + 1:]])}`?" if guess
                        else f"valid keys{' of ' + section if section else ''}: {', '.join(valid)}")
                problems.append(f"`{key}` is not a key of {what} ({hint})")
                break
            model = _section(model.model_fields[part].annotation)
    return problems


def recipe_schema(kind: str) -> type[BaseModel]:
    from posttrain.config.registry import RECIPES, load_builtin_recipes

    load_builtin_recipes()
    return RECIPES[kind].schema


def check_overrides(kind: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` (already flat) when every key is one of recipe ``kind``'s; else ValueError (pydantic
    reports it at the stage's place in the flywheel config)."""
    problems = unknown_keys(recipe_schema(kind), overrides, f"the {kind} recipe")
    if problems:
        raise ValueError(f"overrides: {'; '.join(problems)}")
    return overrides


def stage_config(kind: str, label: str, recipe: str, overrides: dict[str, Any], wiring: dict[str, Any],
                 owner: str | None = None) -> BaseModel:
    """The config stage ``label`` runs: recipe ``kind``'s YAML file ``recipe``, ``overrides`` merged over it key
    by key, then the flywheel's ``wiring`` (paths in the run directory). ConfigError names the stage and
    ``owner``, the flywheel keys the overrides came from (default ``<label>.overrides``)."""
    from posttrain.recipes import find_recipe

    owner = owner or f"{label}.overrides"
    items = [f"{key}={value if isinstance(value, str) else json.dumps(value)}"
             for key, value in {**overrides, **wiring}.items()]
    try:
        return load_config(recipe_schema(kind), find_recipe(recipe), items, overrides_from=owner)
    except ConfigError as exc:
        raise ConfigError([f"flywheel stage {label} ({recipe} + {owner}): {p}" for p in exc.problems]) from None
