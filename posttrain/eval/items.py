"""Evaluation items and suites: what to ask, how to check the answer, which capability it measures.

A suite comes from the ``SUITES`` registry (built-in suites register themselves, e.g. ``posttrain.tasks``
registers ``flywheel``) or from a file:

- ``*.jsonl``: one item per line (``id``, ``prompt``, ``verifier``, ``answer``, ``tests``, ``group``, ``tier``,
  ``options``); every group gets the same weight in the composite index;
- ``*.yaml`` / ``*.json``: ``{name, group_weights: {group: weight}, items: [...] | items_file: path}``
  (``items_file`` is relative to the suite file).

Every item is checked when the suite loads: unknown fields, unknown verifiers and bad verifier options
are errors naming the file, line and field.
"""

from __future__ import annotations

import difflib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from posttrain.data.errors import DataError
from posttrain.data.io import iter_jsonl, json_syntax_error
from posttrain.data.records import Message, RLPrompt, stable_id


def content_hash(prompt: str | list, answer: str | None = None, tests: str | None = None,
                 verifier: str | None = None, options: dict[str, Any] | None = None) -> str:
    """A hash of what an item asks and how its answer is checked: prompt (text, or messages as
    ``{"role", "content"}`` dicts), answer key, tests, verifier and verifier options. Group, tier and id
    are labels, not content. ``posttrain eval`` stores it per item so ``eval compare`` pairs the same
    question, not just the same id."""
    messages = prompt if isinstance(prompt, str) else [
        m.model_dump() if isinstance(m, Message) else {"role": m["role"], "content": m["content"]} for m in prompt
    ]
    payload = {"prompt": messages, "answer": answer, "tests": tests, "verifier": verifier, "options": options or {}}
    return stable_id(payload, "sha256:")


class EvalItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    prompt: str | list[Message]
    verifier: str
    answer: str | None = None
    tests: str | None = None
    group: str = "default"
    tier: int | None = Field(default=None, ge=1, le=3)
    options: dict[str, Any] = Field(default_factory=dict)
    meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("answer", mode="before")
    @classmethod
    def _answer_as_text(cls, value: Any) -> Any:
        # Generators naturally write numeric answers as numbers; the verifiers compare text.
        if isinstance(value, bool):
            return str(value)
        return str(value) if isinstance(value, int | float) else value

    @field_validator("group", mode="before")
    @classmethod
    def _default_group(cls, value: Any) -> Any:
        return "default" if value is None else value

    @classmethod
    def from_rl_prompt(cls, record: RLPrompt, verifier: str | None = None) -> EvalItem:
        """An RL prompt (``posttrain.data.records.RLPrompt``) as an eval item, e.g. to score sampled rollouts."""
        name = verifier or record.verifier
        if not name:
            raise ValueError(f"RL prompt {record.id} names no verifier")
        return cls(
            id=record.id,
            prompt=record.prompt,
            verifier=name,
            answer=record.answer,
            tests=record.tests,
            group=record.group or record.meta.get("group") or "default",
            tier=record.tier,
            options=dict(record.meta.get("verifier_options", {})),
        )

    def content_hash(self) -> str:
        return content_hash(self.prompt, self.answer, self.tests, self.verifier, self.options)

    def prompt_messages(self) -> list[Message]:
        """The prompt as a chat: a plain string becomes one user message."""
        if isinstance(self.prompt, str):
            return [Message(role="user", content=self.prompt)]
        return list(self.prompt)


@dataclass
class Suite:
    """A named list of items and the weight of each capability group in the composite index.

    ``group_weights`` empty means equal weights. Items may be given as dicts; ids must be unique.
    """

    name: str
    items: list[EvalItem]
    group_weights: dict[str, float] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        self.items = [item if isinstance(item, EvalItem) else EvalItem.model_validate(item) for item in self.items]
        seen: set[str] = set()
        for item in self.items:
            if item.id in seen:
                raise ValueError(f"suite {self.name!r}: duplicate item id {item.id!r}")
            seen.add(item.id)
        for group, weight in self.group_weights.items():
            if weight < 0:
                raise ValueError(f"suite {self.name!r}: group weight for {group!r} is negative ({weight})")

    @property
    def groups(self) -> list[str]:
        return sorted({item.group for item in self.items})


class _Registry(dict):
    """A name -> value mapping that refuses to register a name twice."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def __setitem__(self, name: str, value: Any) -> None:
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        super().__setitem__(name, value)


SUITES: dict[str, Callable[[], Suite]] = _Registry("suite")

# Modules whose import registers built-in suites.
_SUITE_MODULES = ("posttrain.eval.builtin_suites", "posttrain.tasks")


def register_suite(name: str, factory: Callable[[], Suite]) -> None:
    SUITES[name] = factory


def _load_builtin_suites() -> None:
    for module in _SUITE_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def load_suite(name_or_path: str | Path) -> Suite:
    """A registered suite by name, or a suite file (``.jsonl``, ``.yaml``, ``.json``); items are validated."""
    path = Path(name_or_path)
    if path.suffix in (".jsonl", ".yaml", ".yml", ".json") or path.exists():
        suite = _suite_from_file(path)
    else:
        _load_builtin_suites()
        name = str(name_or_path)
        if name not in SUITES:
            guess = difflib.get_close_matches(name, list(SUITES), n=1)
            known = ", ".join(sorted(SUITES)) or "none"
            hint = f"did you mean `{guess[0]}`?" if guess else f"registered suites: {known}"
            raise FileNotFoundError(f"suite {name!r}: no such file and no registered suite of that name; {hint}")
        suite = SUITES[name]()
        if not isinstance(suite, Suite):
            suite = Suite(name=name, items=list(suite))
    _check_items(suite.items, source=str(name_or_path))
    return suite


def _check_items(items: list[EvalItem], source: str, lines: list[int] | None = None) -> None:
    from posttrain.eval.verifiers import check_item

    for index, item in enumerate(items):
        problem = check_item(item)
        if problem:
            field_name, reason = problem
            line = lines[index] if lines else None
            raise DataError(source, line, field_name, f"item {item.id!r}: {reason}")


def read_items_jsonl(path: str | Path) -> list[EvalItem]:
    """Read eval items from JSONL; every problem names the file, line and field."""
    items, lines, seen = [], [], {}
    for number, data in iter_jsonl(str(path)):
        item = _validate_item(data, str(path), number)
        if item.id in seen:
            raise DataError(str(path), number, "id", f"duplicate id {item.id!r} (first on line {seen[item.id]})")
        seen[item.id] = number
        items.append(item)
        lines.append(number)
    _check_items(items, str(path), lines)
    return items


def _validate_item(data: dict, source: str, line: int | None) -> EvalItem:
    try:
        return EvalItem.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = ".".join(str(p) for p in error["loc"])
        if error["type"] == "extra_forbidden":
            guess = difflib.get_close_matches(str(error["loc"][-1]), list(EvalItem.model_fields), n=1)
            hint = f"; did you mean `{guess[0]}`?" if guess else f"; valid fields: {', '.join(EvalItem.model_fields)}"
            raise DataError(source, line, loc, f"unknown field{hint}") from None
        raise DataError(source, line, loc or None, error["msg"]) from None


def _suite_from_file(path: Path) -> Suite:
    if not path.exists():
        raise FileNotFoundError(f"{path}: suite file not found")
    if path.suffix == ".jsonl":
        return Suite(name=path.stem, items=read_items_jsonl(path))
    if path.suffix in (".yaml", ".yml"):
        from posttrain.config.loader import read_yaml

        data, _ = read_yaml(path)
    else:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            line, reason = json_syntax_error(exc.doc, exc)
            raise DataError(str(path), line, None, reason) from None
    allowed = {"name", "description", "group_weights", "items", "items_file"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise DataError(str(path), None, unknown[0], f"unknown key; valid keys: {', '.join(sorted(allowed))}")
    if ("items" in data) == ("items_file" in data):
        raise DataError(str(path), None, "items", "give exactly one of `items` (a list) or `items_file` (a JSONL path)")
    if "items_file" in data:
        items = read_items_jsonl(path.parent / data["items_file"])
    else:
        items = [_validate_item(entry, str(path), None) for entry in data["items"]]
    weights = data.get("group_weights") or {}
    if not isinstance(weights, dict) or not all(isinstance(v, int | float) for v in weights.values()):
        raise DataError(str(path), None, "group_weights", "must map group names to numbers")
    try:
        return Suite(data.get("name") or path.stem, items, {k: float(v) for k, v in weights.items()},
                     data.get("description", ""))
    except ValueError as exc:
        raise DataError(str(path), None, None, str(exc)) from None
