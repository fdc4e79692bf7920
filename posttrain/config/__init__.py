"""Typed configs: YAML + dotted command-line overrides, validated before any work starts."""

from posttrain.config.loader import ConfigError, StrictModel, load_config, parse_overrides, resolve_recipe
from posttrain.config.registry import RECIPES, register_recipe

__all__ = [
    "RECIPES",
    "ConfigError",
    "StrictModel",
    "load_config",
    "parse_overrides",
    "register_recipe",
    "resolve_recipe",
]
