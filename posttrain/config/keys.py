"""Every key of a typed config, flattened to dotted names with its type, default and description.

``posttrain <recipe> --help`` prints this list, generated from the pydantic schema itself, so the help
cannot drift from what the loader accepts: a field added to a section appears in ``--help`` with the
text of its ``Field(description=...)``.

Defaults are shown as they would be written in YAML or a ``key=value`` override (``null``, ``true``,
``[0.9, 0.95]``). A section with a default factory other than its own class (e.g. the sampler's judge,
built as ``JudgeConfig(min_score=None)``) shows the defaults of that factory's instance. A section that
defaults to its own class is not instantiated here, because validators of some sections import heavy
modules (the DPO loss registry imports torch) and ``--help`` must stay fast.
"""

from __future__ import annotations

import json
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from posttrain.config.loader import _model_in

MAX_DEFAULT_CHARS = 80  # longer defaults (intent example lists) are cut with "…"; the recipe shows them whole
REQUIRED = object()  # marks a key without a default
SECTION = object()  # marks a section header whose keys follow with their own defaults


@dataclass(frozen=True)
class ConfigKey:
    key: str  # dotted, e.g. train.lr
    type: str  # e.g. float, int | None, cosine|linear|constant
    default: Any  # REQUIRED when the key must be given
    description: str

    def render(self) -> str:
        if self.default is SECTION:
            text = f"{self.key} ({self.type})"
        else:
            shown = format_value(self.default)
            if len(shown) > MAX_DEFAULT_CHARS:
                shown = shown[: MAX_DEFAULT_CHARS - 1] + "…"
            default = "required" if self.default is REQUIRED else f"default {shown}"
            text = f"{self.key} ({self.type}, {default})"
        return f"{text}: {self.description}" if self.description else text


def type_name(annotation: Any) -> str:
    """A short, readable name for a field's annotation: ``float``, ``str | None``, ``a|b|c`` for a Literal."""
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "any"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return "|".join(str(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(arg) for arg in args)}]" if args else name
    return getattr(annotation, "__name__", str(annotation))


def format_value(value: Any) -> str:
    """A default as it is written in YAML / on the command line."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, str):
        return value if value else '""'
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:
        return str(value)


def _field_default(field: Any) -> Any:
    if field.default is not PydanticUndefined:
        return field.default
    if field.default_factory is not None:
        return field.default_factory()
    return REQUIRED


def _section_default(field: Any, section: type[BaseModel]) -> BaseModel | None | object:
    """The instance a section defaults to; its own class (not instantiated, see the module docstring) → REQUIRED."""
    if field.default is not PydanticUndefined:
        return field.default
    factory = field.default_factory
    if factory is None or factory is section:
        return REQUIRED
    return factory()


def config_keys(schema: type[BaseModel], prefix: str = "", defaults: BaseModel | None = None) -> list[ConfigKey]:
    """Every key of ``schema``, depth first in declaration order; nested sections become dotted keys.

    ``defaults``: an instance whose values replace the class defaults (a section built by a factory).
    """
    keys: list[ConfigKey] = []
    for name, field in schema.model_fields.items():
        dotted = f"{prefix}{name}"
        description = " ".join((field.description or "").split())
        section = _model_in(field.annotation)
        direct = section is not None and (
            field.annotation is section
            or (typing.get_origin(field.annotation) in (typing.Union, types.UnionType)
                and set(typing.get_args(field.annotation)) <= {section, type(None)})
        )
        if not direct:
            default = getattr(defaults, name) if defaults is not None else _field_default(field)
            keys.append(ConfigKey(dotted, type_name(field.annotation), default, description))
            continue
        instance = getattr(defaults, name) if defaults is not None else _section_default(field, section)
        if instance is None:  # an optional section, off by default; its keys apply once it is set
            keys.append(ConfigKey(dotted, type_name(field.annotation), None, description))
        elif description:
            keys.append(ConfigKey(dotted, "section, required" if instance is REQUIRED else "section", SECTION,
                                  description))
        nested_defaults = instance if isinstance(instance, BaseModel) else None
        keys.extend(config_keys(section, f"{dotted}.", nested_defaults))
    return keys


def format_config_keys(schema: type[BaseModel], width: int = 100) -> str:
    """The ``--help`` block: one entry per key, long descriptions wrapped under it."""
    lines = ["config keys (set them in the YAML file or as key=value overrides):"]
    for entry in config_keys(schema):
        lines.extend(textwrap.wrap(entry.render(), width=width, initial_indent="  ", subsequent_indent="      ",
                                   break_on_hyphens=False))
    return "\n".join(lines)
