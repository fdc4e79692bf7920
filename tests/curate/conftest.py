"""Helpers for the curation tests: write raw JSONL, build a curate config with overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.curate.config import CurateRecipe


def write_jsonl(path: Path, records: list) -> Path:
    """Records may be dicts (dumped as JSON), str (written as is) or bytes (raw, e.g. invalid UTF-8)."""
    with open(path, "wb") as handle:
        for record in records:
            if isinstance(record, bytes):
                handle.write(record + b"\n")
            elif isinstance(record, str):
                handle.write(record.encode("utf-8") + b"\n")
            else:
                handle.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line]


# Stages that load no model: fast enough for property tests.
LIGHT = ["intent.method=judge", "executor.workers=0", "progress=false"]


def make_config(input_path: Path, output_dir: Path, *overrides: str) -> CurateRecipe:
    base = [f"data.input={input_path}", f"output_dir={output_dir}", *LIGHT]
    return load_config(CurateRecipe, None, [*base, *overrides])


def pair(prompt: str, response: str, **extra) -> dict:
    return {"prompt": prompt, "response": response, **extra}


@pytest.fixture
def raw_pool_file(tmp_path) -> Path:
    """The built-in noisy task pool plus a few broken lines."""
    from posttrain.tasks.pool import raw_pool

    records: list = list(raw_pool(240, seed=3))
    records += ["not json at all", b"\xff\xfe\x00 bad bytes", "", json.dumps({"foo": 1})]
    return write_jsonl(tmp_path / "raw.jsonl", records)
