"""Validation of Kubernetes manifests without a cluster: the pinned JSON schemas in deploy/schemas/ and yamllint.

The vendored schemas are the API's own (CRD openAPIV3Schema, Kubernetes' Swagger definitions). Two things are
added here, at load time, so that a typo cannot pass: every object that lists ``properties`` rejects others
(``additionalProperties: false``, what ``kubectl --validate=strict`` does) unless it says it keeps unknown
fields (``x-kubernetes-preserve-unknown-fields``), and a document's apiVersion/kind must name a vendored schema.
Kubernetes' own extensions (``x-kubernetes-validations`` CEL rules, list types) are not checked. Patterns are
Go RE2; the one construct Python's ``re`` reads differently, an inline flag after the start (``^(?i)…``), is
moved to the front.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import yaml
from jsonschema import Draft7Validator
from yamllint import linter
from yamllint.config import YamlLintConfig

REPO = Path(__file__).resolve().parents[2]
SCHEMA_DIR = REPO / "deploy" / "schemas"
YAMLLINT_CONFIG = REPO / ".yamllint"


def python_pattern(pattern: str) -> str:
    """An RE2 ``pattern`` as Python's ``re`` reads it: ``^(?i)(a|b)$`` → ``(?i)^(a|b)$``."""
    if "(?i)" in pattern and not pattern.startswith("(?i)"):
        return "(?i)" + pattern.replace("(?i)", "", 1)
    return pattern


def strict(node):
    """``node`` with ``additionalProperties: false`` on every object schema that lists its properties."""
    if isinstance(node, dict):
        out = {key: (strict(value) if key != "properties" else {k: strict(v) for k, v in value.items()})
               for key, value in node.items()}
        if isinstance(out.get("pattern"), str):
            out["pattern"] = python_pattern(out["pattern"])
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [strict(item) for item in node]
    return node


@functools.cache
def schemas() -> dict[tuple[str, str], Draft7Validator]:
    """(apiVersion, kind) → validator, one per vendored schema file."""
    out = {}
    for path in sorted(SCHEMA_DIR.glob("*.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        which = schema["x-posttrain-kind"]
        out[(which["apiVersion"], which["kind"])] = Draft7Validator(strict(schema))
    return out


def schema_errors(document: dict) -> list[str]:
    """Every problem with one manifest, as ``kind/name: path: message``; empty when it is valid."""
    key = (document.get("apiVersion"), document.get("kind"))
    name = f"{key[1]}/{(document.get('metadata') or {}).get('name')}"
    validator = schemas().get(key)
    if validator is None:
        return [f"{name}: no vendored schema for apiVersion {key[0]!r} kind {key[1]!r}"]
    return [f"{name}: {'.'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message}"
            for error in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))]


def lint_errors(text: str, where: str = "<rendered>") -> list[str]:
    config = YamlLintConfig(file=str(YAMLLINT_CONFIG))
    path = where if Path(where).is_file() else None  # per-path rules (.yamllint's ignores) need the file's path
    return [f"{where}:{p.line}:{p.column}: {p.level}: {p.message}" for p in linter.run(text, config, path)]


def load_documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]
