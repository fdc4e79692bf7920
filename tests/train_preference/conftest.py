"""Preference-test helpers: a learnable synthetic preference set and a tiny model whose vocabulary has its words.

The preference depends on the prompt: "Name two fruits." prefers fruit words, "Name two stones." prefers
stone words, half of the pairs each. A freshly initialised model has no idea which prompt wants which, so
its held-out preference accuracy sits near 50% whatever its random bias toward either set of words; a
model that learns to read the prompt gets near 100%.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.train.conftest import env, read_jsonl  # noqa: F401 - re-exported for the tests here

FRUITS = ["apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum"]
STONES = ["rock", "stone", "brick", "sand", "slate", "clay", "flint", "gravel"]


def preference_rows(n: int, seed: int, conditional: bool = True) -> list[dict]:
    """``conditional``: the prompt says which kind is wanted (half each); otherwise fruits are always preferred."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        wants_fruit = i % 2 == 0 or not conditional
        good, bad = (FRUITS, STONES) if wants_fruit else (STONES, FRUITS)
        topic = "fruits" if wants_fruit else "stones"
        g1, g2 = rng.sample(good, 2)
        b1, b2 = rng.sample(bad, 2)
        rows.append({
            "prompt": f"Item {rng.randint(0, 999)}. Name two {topic}.",
            "chosen": f"{g1} and {g2}.",
            "rejected": f"{b1} and {b2}.",
            "rationale": f"asked for {topic}; the rejected answer names the other kind",
            "chosen_score": 9.0,
            "rejected_score": 2.0,
            "tier": 1 + i % 3,
        })
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="session")
def pref_model_dir(tmp_path_factory) -> str:
    """A 2-layer, 64-wide Llama whose BPE vocabulary holds every fruit and stone word."""
    from posttrain.models.tiny import build_tiny_model

    texts = [" ".join(FRUITS + STONES + ["and", "Item", "Name", "two", "fruits", "stones", "."])] * 8
    texts += [f"Item {i}. Name two fruits. apple and plum." for i in range(0, 1000, 7)]
    path = tmp_path_factory.mktemp("pref") / "model"
    return str(build_tiny_model(path, texts=texts, vocab_size=300, seed=0))


@pytest.fixture(scope="session")
def pref_data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefdata")
    return {
        "train": str(write_jsonl(root / "train.jsonl", preference_rows(192, seed=1))),
        "eval": str(write_jsonl(root / "eval.jsonl", preference_rows(64, seed=2))),
    }


def dpo_overrides(model: str, data: dict[str, str], out: Path, **extra) -> list[str]:
    settings = {
        "model.path": model,
        "data.train": data["train"],
        "output_dir": str(out),
        "train.batch_size": 8,
        "train.max_length": 64,
        "train.max_steps": 4,
        "train.lr": 1e-3,
        "train.lr_schedule": "constant",
        "train.seed": 0,
        "metrics.tensorboard": "false",
        "dpo.min_pairs": 1,  # the sets here are a few pairs; test_dpo_min_pairs tests the minimum
    }
    if data.get("eval"):
        settings["data.eval"] = data["eval"]
    settings.update(extra)
    return [f"{k}={v}" for k, v in settings.items()]


def rm_overrides(model: str, data: dict[str, str], out: Path, **extra) -> list[str]:
    """``dpo_overrides`` for ``posttrain rm``: the same keys, without ``dpo.min_pairs`` (rm has no ``dpo:``)."""
    return [item for item in dpo_overrides(model, data, out, **extra) if not item.startswith("dpo.min_pairs=")]


def run_cli(command: str, overrides: list[str]) -> int:
    from posttrain.cli import main

    return main([command, *overrides])
