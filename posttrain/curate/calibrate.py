"""Measure the curation defaults on real, clean text: what the filters drop, what near-dedup finds, how tiers spread.

The calibration set (``calibration/real_text.jsonl.gz``, built by ``benchmarks/build_curate_calibration.py``;
provenance and licences in ``calibration/README.md``) holds clean chat records whose answers are
human-written text: Python's language reference and stdlib docstrings, and Debian package
descriptions. Every record is clean and distinct, so

- every record a heuristic filter drops is a false drop (``filter_drops``);
- near-duplicates are planted by changing ``edits`` words of a response (``plant_word_edits``), and
  the near-dup stage is scored on the clean records plus the edits (``near_dup_quality``): recall =
  edits clustered with their source, precision = verified pairs that join a record and its own edit;
- the tiers the judge + difficulty stages give the kept records should spread (``tier_spread``).

``calibrate(recipe)`` runs all three with a curate recipe's settings (the defaults unless overridden)
and returns the figures ``benchmarks/curate_calibration.py`` prints and the tests check.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.curate.config import CurateRecipe
from posttrain.curate.dedup import NearDedupStage
from posttrain.curate.difficulty import DifficultyStage
from posttrain.curate.filters import FilterStage
from posttrain.curate.judge import JudgeStage
from posttrain.curate.minhash import connected_components
from posttrain.curate.normalize import NormalizeStage
from posttrain.curate.rows import Row, row_from_record

CALIBRATION_SET = Path(__file__).with_name("calibration") / "real_text.jsonl.gz"
SHORT_WORDS = 60  # a response of at most this many words is a "short text"
_EDITABLE = re.compile(r"(?<![\w.])[A-Za-z]{2,}(?![\w(])")  # plain words, not identifiers or calls


def load_calibration_set(path: str | Path = CALIBRATION_SET) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def normalized_rows(records: list[dict[str, Any]], recipe: CurateRecipe) -> list[Row]:
    rows = []
    for index, record in enumerate(records):
        row = row_from_record(record, index, "calibration", index + 1)
        if not isinstance(row, Row):
            raise ValueError(f"calibration record {record.get('id')}: {row.reason} {row.detail}")
        rows.append(row)
    if recipe.normalize.enabled:
        NormalizeStage(recipe.normalize).apply(rows)
    return rows


# -- filters ---------------------------------------------------------------------------------
def filter_drops(rows: list[Row], recipe: CurateRecipe) -> tuple[list[bool], Counter]:
    """Which rows the heuristic filters keep, and the drop count per reason (every drop of a clean row is false)."""
    verdicts = FilterStage(recipe.filters).apply(rows) if recipe.filters.enabled else [None] * len(rows)
    return [v is None for v in verdicts], Counter(v.reason for v in verdicts if v is not None)


# -- near-duplicates -------------------------------------------------------------------------
def plant_word_edits(text: str, rng: random.Random, vocabulary: list[str], edits: int = 2) -> str:
    """``text`` with ``edits`` distinct plain words each replaced by a different word from ``vocabulary``."""
    spans = [m.span() for m in _EDITABLE.finditer(text)]
    if len(spans) < edits:
        raise ValueError(f"text has {len(spans)} plain words; need {edits} to edit")
    chosen = sorted(rng.sample(range(len(spans)), edits), reverse=True)
    for position in chosen:  # right to left, so earlier spans stay valid
        start, end = spans[position]
        original = text[start:end].lower()
        replacement = rng.choice(vocabulary)
        while replacement == original:
            replacement = rng.choice(vocabulary)
        text = text[:start] + replacement + text[end:]
    return text


def near_dup_quality(
    records: list[dict[str, Any]], recipe: CurateRecipe, edits: int = 2, seed: int = 0
) -> dict[str, Any]:
    """Plant one ``edits``-word edit of every clean response, run the near-dup stage on clean + edited, score it.

    Returns recall on short (≤ ``SHORT_WORDS`` words) and longer responses, precision over all verified
    pairs (a pair is right when both sides come from the same clean record), and the false pairs'
    ids (two distinct clean records, or an edit matched to another record's family).
    """
    rng = random.Random(seed)
    vocabulary = sorted({w.lower() for r in records for w in _EDITABLE.findall(r["response"]) if 3 <= len(w) <= 10})
    planted = []
    for record in records:
        edited = plant_word_edits(record["response"], rng, vocabulary, edits)
        planted.append({**record, "id": f"{record['id']}#edit", "response": edited})
    rows = normalized_rows(records + planted, recipe)
    family = np.array([i % len(records) for i in range(len(rows))])
    stage = NearDedupStage(recipe.near_dedup)
    with tempfile.TemporaryDirectory(prefix="calibration-") as scratch:
        features = stage.features(rows, f"{scratch}/shard")
        stage.decide([features], np.ones(len(rows), dtype=bool), [r.id for r in rows])
    pairs = stage.verified_pairs
    labels = connected_components(len(rows), pairs)
    caught = labels[len(records) :] == labels[: len(records)]
    short = np.array([len(r["response"].split()) <= SHORT_WORDS for r in records])
    right = family[pairs[:, 0]] == family[pairs[:, 1]] if pairs.size else np.zeros(0, dtype=bool)
    false_pairs = [[rows[i].id, rows[j].id] for (i, j), ok in zip(pairs.tolist(), right, strict=True) if not ok]
    return {
        "short_texts": int(short.sum()),
        "long_texts": int((~short).sum()),
        "recall_short": round(float(caught[short].mean()), 4) if short.any() else None,
        "recall_long": round(float(caught[~short].mean()), 4) if (~short).any() else None,
        "pairs_flagged": int(pairs.shape[0]),
        "precision": round(float(right.mean()), 4) if pairs.size else 1.0,
        "false_pairs": false_pairs,
    }


# -- tiers -----------------------------------------------------------------------------------
def tier_spread(rows: list[Row], recipe: CurateRecipe) -> tuple[dict[int, int], int]:
    """Tiers that the judge (as configured; the rule judge by default) and the difficulty stage give
    ``rows`` (any given tier ignored), and how many rows the judge dropped."""
    if recipe.judge.enabled:
        judge = JudgeStage(recipe.judge.model_copy(update={"cache": False}), list(recipe.intent.labels))
        verdicts = judge.apply(rows)
        rows = [row for row, verdict in zip(rows, verdicts, strict=True) if verdict is None]
        judged_out = sum(v is not None for v in verdicts)
    else:
        judged_out = 0
    for row in rows:
        row.tier = None
    DifficultyStage(recipe.difficulty).apply(rows)
    counts = Counter(row.tier for row in rows)
    return {tier: counts.get(tier, 0) for tier in (1, 2, 3)}, judged_out


def calibrate(recipe: CurateRecipe, records: list[dict[str, Any]] | None = None, seed: int = 0) -> dict[str, Any]:
    records = load_calibration_set() if records is None else records
    rows = normalized_rows(records, recipe)
    kept, reasons = filter_drops(rows, recipe)
    tiers, judged_out = tier_spread([row for row, ok in zip(rows, kept, strict=True) if ok], recipe)
    by_source = Counter(r["meta"]["source"] for r in records)
    dropped_by_source = Counter(r["meta"]["source"] for r, ok in zip(records, kept, strict=True) if not ok)
    return {
        "records": len(records),
        "sources": dict(sorted(by_source.items())),
        "filter_drop_rate": round(1 - sum(kept) / len(records), 4),
        "filter_drops": dict(sorted(reasons.items())),
        "filter_drops_by_source": dict(sorted(dropped_by_source.items())),
        "judge_drops": judged_out,
        "near_dup": near_dup_quality(records, recipe, seed=seed),
        "tiers": tiers,
    }
