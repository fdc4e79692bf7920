"""The curation defaults measured on real, clean text (the vendored calibration set), and the pieces
that make them hold: character shingles, the prompt check, the repetition allowance, log-scale length.

The calibration figures are measured properties of the code on fixed data (the set is vendored, the
edits seeded): they fail if a change to the filters, the near-dup stage or the tiers regresses them.
"""

from __future__ import annotations

import json
import math
import random
import re

import numpy as np
import pytest

from posttrain.config import load_config
from posttrain.curate.calibrate import CALIBRATION_SET, calibrate, load_calibration_set, plant_word_edits
from posttrain.curate.config import CurateRecipe, FiltersConfig, NearDedupConfig
from posttrain.curate.dedup import NearDedupStage
from posttrain.curate.difficulty import length_signal
from posttrain.curate.filters import FilterStage, duplicate_line_fractions, repetition_limit
from posttrain.curate.minhash import MinHasher, exact_jaccard
from posttrain.curate.rows import Row

from .conftest import make_config, read_jsonl


def recipe(*overrides: str) -> CurateRecipe:
    return load_config(CurateRecipe, None, ["data.input=calibration", "output_dir=unused", *overrides])


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_calibration_set()


@pytest.fixture(scope="module")
def figures(records) -> dict:
    return calibrate(recipe(), records)


# -- the calibration set and the targets ----------------------------------------------------------
def test_the_vendored_set_is_small_real_text_with_provenance(records):
    assert CALIBRATION_SET.stat().st_size < 1_000_000
    assert len(records) >= 600 and len({r["id"] for r in records}) == len(records)
    assert {r["meta"]["source"] for r in records} == {"python-reference", "python-docstring", "debian-description"}
    assert all(r["meta"]["licence"] and r["meta"]["origin"] for r in records)
    assert (CALIBRATION_SET.parent / "README.md").exists()


def test_filters_drop_at_most_one_percent_of_clean_real_text(figures):
    assert figures["filter_drop_rate"] <= 0.01, figures["filter_drops"]


def test_two_word_edits_are_caught_with_high_precision(figures):
    near = figures["near_dup"]
    assert near["short_texts"] >= 200 and near["long_texts"] >= 200
    assert near["recall_short"] >= 0.9 and near["recall_long"] >= 0.9, near
    assert near["precision"] >= 0.95, near["false_pairs"][:5]


def test_tiers_spread_on_real_text(figures):
    tiers = figures["tiers"]
    kept = sum(tiers.values())
    assert all(0.1 * kept <= count <= 0.7 * kept for count in tiers.values()), tiers


def test_the_measurement_tells_the_old_rules_apart(records):
    """The same measurement on the previous defaults misses the targets, so the tests above can fail."""
    words = calibrate(recipe("near_dedup.shingle=words", "near_dedup.bands=14", "near_dedup.rows=8",
                             "near_dedup.threshold=0.8", "filters.repetition_allowance=0",
                             "difficulty.tier_thresholds=[0.34,0.6]"), records)  # fmt: skip
    assert words["near_dup"]["recall_short"] < 0.5
    assert words["filter_drop_rate"] > 0.03
    assert words["tiers"][3] == 0


def test_planted_edits_change_exactly_two_plain_words():
    rng = random.Random(1)
    text = "The quick brown fox jumps over the lazy dog near os.path.join(a, b) today."
    edited = plant_word_edits(text, rng, ["alpha", "beta", "gamma"])
    before, after = text.split(), edited.split()
    assert len(before) == len(after) and sum(a != b for a, b in zip(before, after, strict=True)) == 2
    assert "os.path.join(a," in after  # identifiers and calls are not edited


# -- character shingles -------------------------------------------------------------------------
def reference_char_shingles(text: str, k: int) -> list[bytes]:
    """The documented rule, in plain Python: lower-case, words cut at ASCII whitespace/punctuation,
    joined by one space, k-byte windows of the UTF-8."""
    stream = " ".join(w for w in re.split(r"[\s!-/:-@\[-`{-~\x00-\x1f]+", text.lower()) if w).encode()
    if not stream:
        return []
    return [stream] if len(stream) < k else [stream[i : i + k] for i in range(len(stream) - k + 1)]


def test_char_shingles_follow_the_documented_rule():
    texts = ["Ab, c!!", "", "  x  ", "Hello   world", "ab c", "...", "hi", "naïve café, déjà vu"]
    hasher = MinHasher(16, 3, seed=0, shingle="chars")
    hashes, counts = hasher.shingle_hashes(texts)
    assert counts.tolist() == [len(reference_char_shingles(t, 3)) for t in texts] == [2, 0, 1, 9, 2, 0, 1, counts[-1]]
    # Equal k-grams hash equally across texts, different k-grams differently.
    seen: dict[bytes, int] = {}
    for gram, value in zip([g for t in texts for g in reference_char_shingles(t, 3)], hashes.tolist(), strict=True):
        assert seen.setdefault(gram, value) == value
    assert len(set(seen.values())) == len(seen)


def test_char_shingles_ignore_case_punctuation_and_spacing():
    hasher = MinHasher(32, 5, seed=0, shingle="chars")
    a, b = hasher.signatures(["Return the sum, of x and y.", "return  the SUM of x\nand y"])
    assert np.array_equal(a, b)


def test_char_shingle_jaccard_by_hand():
    # "abcdef" → abc bcd cde def; "abcdeg" → abc bcd cde deg: 3 shared of 5.
    hasher = MinHasher(16, 3, seed=0, shingle="chars")
    values, offsets = hasher.shingle_sets(["abcdef", "abcdeg"])
    pairs = np.array([[0, 1]])
    assert exact_jaccard(pairs, lambda i: values[offsets[i] : offsets[i + 1]])[0] == pytest.approx(3 / 5)


def test_vectorised_exact_jaccard_matches_python_sets():
    rng = np.random.default_rng(0)
    sets = [rng.integers(0, 60, size=rng.integers(0, 40)).astype(np.uint32) for _ in range(120)]
    pairs = rng.integers(0, 120, size=(800, 2))
    got = exact_jaccard(pairs, lambda i: sets[i], chunk_values=300)  # many small chunks
    for (i, j), value in zip(pairs.tolist(), got, strict=True):
        a, b = set(sets[i].tolist()), set(sets[j].tolist())
        assert value == pytest.approx(len(a & b) / len(a | b) if a | b else 0.0)


def row(index: int, prompt: str, response: str) -> Row:
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return Row(index=index, source="t", line=index + 1, id=f"r{index}", messages=messages)


def near_dup_drops(rows: list[Row], config: NearDedupConfig, tmp_path) -> set[str]:
    stage = NearDedupStage(config)
    decisions = stage.decide([stage.features(rows, str(tmp_path / "s"))], np.ones(len(rows), bool), [r.id for r in rows])
    return {rows[i].id for i in decisions.drops}


PREAMBLE = "Please read the short task below with care and reply with the answer only."


def test_prompt_check_keeps_templated_tasks_apart_and_edited_answers_together(tmp_path):
    answer = ("Return a new list containing all items from the iterable in ascending order. A custom key function "
              "can be supplied to customize the sort order, and the reverse flag can be set to request the result "
              "in descending order.")  # fmt: skip
    rows = [
        row(0, f"{PREAMBLE} This one is about 13 and 1. What is 13 - 1?", "12"),
        row(1, f"{PREAMBLE} This one is about 20 and 5. What is 20 - 5?", "15"),  # another task: kept
        row(2, "What does sorted do?", answer),
        row(3, "What does sorted do?", answer.replace("items", "things").replace("custom", "special")),
    ]
    assert near_dup_drops(rows, NearDedupConfig(), tmp_path) == {"r3"}
    # Without the prompt check, character shingles alone merge the two templated tasks.
    assert "r1" in near_dup_drops(rows, NearDedupConfig(min_prompt_jaccard=None), tmp_path)
    # The previous rule (5-word shingles at 0.8) misses the edited answer.
    words = NearDedupConfig(shingle="words", bands=14, rows=8, threshold=0.8, min_prompt_jaccard=None)
    assert near_dup_drops(rows, words, tmp_path) == set()


def test_builtin_pool_keeps_every_clean_record_through_filters_and_dedup(raw_pool_file, tmp_path):
    from posttrain.curate.pipeline import curate

    out = tmp_path / "out"
    curate(make_config(raw_pool_file, out))
    dropped = [d for d in read_jsonl(out / "dropped.jsonl") if isinstance(d["record"], dict)]
    assert not [d["id"] for d in dropped if d["record"]["meta"].get("planted") is None]
    planted = [json.loads(line) for line in raw_pool_file.read_bytes().splitlines()[:-4]]
    near = {r["id"] for r in planted if r["meta"]["planted"] == "near_duplicate"}
    caught = {d["id"] for d in dropped if d["reason"] in ("near_duplicate", "exact_duplicate")}
    assert near and near <= caught


# -- repetition allowance and length -----------------------------------------------------------
def test_repetition_limit_by_hand():
    assert repetition_limit(0.15, 5, 100, 4.0, "duplicate") == pytest.approx(0.15 + 4 * 10 / 100)
    assert repetition_limit(0.20, 2, 400, 4.0, "top") == pytest.approx(0.20 + 4 * 2 / 400)
    assert repetition_limit(0.15, 5, 100, 0.0, "duplicate") == 0.15


def test_degenerate_repetition_is_still_dropped_with_the_allowance():
    sentence = "The function returns the value of the key if the key is in the dictionary. "
    looped = row(0, "What does dict.get do?", sentence * 8)
    # A loop over about half of a 220-word answer; a loop over a third of it is within the allowance.
    half = row(1, "Explain lists.", " ".join(f"word{i}" for i in range(100)) + " " + sentence * 8)
    verdicts = FilterStage(FiltersConfig()).apply([looped, half])
    assert [v.reason if v else None for v in verdicts] == ["top_ngram_repetition", "duplicate_ngram_repetition"]


def test_table_borders_are_not_words():
    border = "+------------+----------------------+"
    rows = ["| + | addition |", "| - | subtraction |", "| * | multiplication |", "| / | division |", "| % | remainder |"]
    table = "\n".join(line for content in rows for line in (border, content)) + "\n" + border
    response = table + "\n" + " ".join(f"token{i}" for i in range(60))
    record = row(0, "Show the operator table.", response)
    assert FilterStage(FiltersConfig()).apply([record]) == [None]
    # Six identical border lines of eleven: Gopher would count 5 of 11 lines as repeats; they have no letter or digit.
    assert duplicate_line_fractions(table) == (0.0, 0.0)


def test_length_signal_by_hand():
    assert length_signal(5, 300) == 0.0 and length_signal(10, 300) == 0.0
    assert length_signal(300, 300) == 1.0 and length_signal(1000, 300) == 1.0
    assert length_signal(100, 300) == pytest.approx(math.log(10) / math.log(30))
