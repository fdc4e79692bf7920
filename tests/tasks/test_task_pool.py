"""The raw pool: planted noise in the stated proportions, each kind really noisy, the rest really clean."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

import posttrain.tasks as tasks
from posttrain.tasks.pool import garble, truncate

POOL_SIZE = 500
NEAR_DUPLICATE_JACCARD = 0.8  # 5-word shingles, as the curation funnel uses
_MOJIBAKE_MARKERS = ("\ufffd", "Ã", "â€")


@pytest.fixture(scope="module")
def pool():
    return tasks.raw_pool(POOL_SIZE, seed=3)


def shingles(text: str, size: int = 5) -> set[tuple[str, ...]]:
    # Written again here rather than imported, so a bug in the pool's own similarity code shows.
    words = [w for w in re.split(r"[\W_]+", text.lower()) if w]
    return {tuple(words[i : i + size]) for i in range(max(1, len(words) - size + 1))}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def _kind(record):
    return record["meta"]["planted"]


def test_pool_is_deterministic_and_ids_are_unique(pool):
    assert pool == tasks.raw_pool(POOL_SIZE, seed=3)
    assert pool != tasks.raw_pool(POOL_SIZE, seed=4)
    assert len({r["id"] for r in pool}) == POOL_SIZE
    assert all(set(r) == {"id", "prompt", "response", "tier", "meta"} for r in pool)
    assert all(r["tier"] == r["meta"]["tier"] for r in pool)


def test_planted_kinds_come_in_the_stated_proportions(pool):
    mix = tasks.NoiseMix()
    counts = Counter(_kind(r) or "clean" for r in pool)
    assert counts == Counter(mix.counts(POOL_SIZE))
    for kind in tasks.NOISE_KINDS:
        assert abs(counts[kind] / POOL_SIZE - getattr(mix, kind)) <= 1 / POOL_SIZE, kind
    assert sum(counts.values()) == POOL_SIZE


def test_a_custom_mix_is_honoured_and_bad_mixes_are_refused():
    mix = tasks.NoiseMix(
        exact_duplicate=0.2, near_duplicate=0.0, garbled=0.1, empty=0.0, truncated=0.0, wrong_answer=0.3
    )
    counts = Counter(_kind(r) or "clean" for r in tasks.raw_pool(100, seed=0, noise=mix))
    assert counts == {"clean": 40, "exact_duplicate": 20, "garbled": 10, "wrong_answer": 30}
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        tasks.NoiseMix(garbled=-0.1)
    with pytest.raises(ValueError, match="add up to"):
        tasks.NoiseMix(wrong_answer=0.8)


def test_clean_records_are_right_and_readable(pool, verify):
    for record in pool:
        if _kind(record) is None:
            meta = record["meta"]
            assert record["prompt"].isascii() and record["prompt"].endswith(meta["task_prompt"])
            assert record["response"] == meta["answer"]
            assert verify(meta["verifier"], record["response"], meta["answer"], meta["verifier_options"])


def test_exact_duplicates_copy_a_clean_record(pool):
    by_id = {r["id"]: r for r in pool}
    for record in (r for r in pool if _kind(r) == "exact_duplicate"):
        source = by_id[record["meta"]["duplicate_of"]]
        assert _kind(source) is None
        assert (record["prompt"], record["response"]) == (source["prompt"], source["response"])


def test_near_duplicates_are_close_to_their_source_but_not_identical(pool):
    by_id = {r["id"]: r for r in pool}
    for record in (r for r in pool if _kind(r) == "near_duplicate"):
        source = by_id[record["meta"]["duplicate_of"]]
        assert _kind(source) is None and record["prompt"] != source["prompt"]
        assert jaccard(record["prompt"], source["prompt"]) >= NEAR_DUPLICATE_JACCARD
        both = (f"{record['prompt']} {record['response']}", f"{source['prompt']} {source['response']}")
        assert jaccard(*both) >= NEAR_DUPLICATE_JACCARD
        changed = set(record["prompt"].split()) ^ set(source["prompt"].split())
        assert 1 <= len(changed) <= 2


def test_distinct_problems_are_never_near_duplicates(pool):
    # A perfect near-dup filter must find exactly the planted pairs, nothing more.
    originals = [r for r in pool if _kind(r) not in ("exact_duplicate", "near_duplicate")]
    sets = [shingles(r["prompt"]) for r in originals]
    worst = max(len(a & b) / len(a | b) for a, b in itertools.combinations(sets, 2))
    assert worst < NEAR_DUPLICATE_JACCARD
    assert len({r["meta"]["task_prompt"] for r in originals}) == len(originals)


def test_garbled_records_carry_broken_encoding(pool):
    garbled = [r for r in pool if _kind(r) == "garbled"]
    assert garbled
    for record in garbled:
        assert any(marker in record["prompt"] for marker in _MOJIBAKE_MARKERS)
        assert record["prompt"] != record["meta"]["task_prompt"]


def test_empty_truncated_and_wrong_responses_fail_their_check(pool, verify):
    for record in pool:
        meta, response = record["meta"], record["response"]
        if _kind(record) == "empty":
            assert not response.strip()
        elif _kind(record) == "truncated":
            assert meta["answer"].startswith(response) and 0 < len(response) < len(meta["answer"])
        elif _kind(record) == "wrong_answer":
            assert response != meta["answer"]
        else:
            continue
        assert not verify(meta["verifier"], response, meta["answer"], meta["verifier_options"]), record


def test_garble_and_truncate_always_change_their_input():
    import random

    rng = random.Random(0)
    for text in ("What is 1 + 2?", "Sort these numbers: 5 2 9", "x"):
        for _ in range(50):
            assert garble(text, rng) != text
    for answer in ("12", "- a\n- b\n- c", "Answer: cat", '{"name": "cat"}', "c d s"):
        for _ in range(20):
            cut = truncate(answer, rng)
            assert cut and answer.startswith(cut) and cut != answer


def test_duplicates_come_after_their_source(pool):
    position = {r["id"]: index for index, r in enumerate(pool)}
    copies = [r for r in pool if _kind(r) in ("exact_duplicate", "near_duplicate")]
    assert copies
    assert all(position[r["meta"]["duplicate_of"]] < position[r["id"]] for r in copies)


def test_the_funnels_near_dup_detector_drops_exactly_the_planted_copies(pool):
    # posttrain.curate's MinHash + LSH with exact verification at Jaccard 0.8, keeping first occurrences.
    from posttrain.curate.minhash import MinHasher, near_duplicate_clusters

    texts = [f"{r['prompt']}\n{r['response']}" for r in pool]
    signatures, values, offsets = MinHasher(112, 5, 0).sign(texts, True)
    labels, _ = near_duplicate_clusters(
        signatures, 14, 8, 0.8, verify="exact", shingle_set_of=lambda i: values[offsets[i] : offsets[i + 1]]
    )
    dropped = {pool[i]["id"] for i in range(len(pool)) if labels[i] != i}
    planted = {r["id"] for r in pool if _kind(r) in ("exact_duplicate", "near_duplicate")}
    assert dropped == planted


def test_preamble_share_leaves_clean_records_bare_and_keeps_near_duplicates_near():
    pool = tasks.raw_pool(300, seed=1, preamble_share=0.25)
    clean = [r for r in pool if r["meta"]["planted"] is None]
    bare = [r for r in clean if r["prompt"] == r["meta"]["task_prompt"]]
    assert 0.6 < len(bare) / len(clean) < 0.9
    planted = [r for r in pool if r["meta"]["planted"] not in (None, "exact_duplicate")]
    assert all(r["prompt"] != r["meta"]["task_prompt"] for r in planted)
    by_id = {r["id"]: r for r in pool}
    near = [r for r in pool if r["meta"]["planted"] == "near_duplicate"]
    assert near and all(jaccard(r["prompt"], by_id[r["meta"]["duplicate_of"]]["prompt"]) >= 0.8 for r in near)
    with pytest.raises(ValueError, match="preamble_share"):
        tasks.raw_pool(10, seed=1, preamble_share=1.5)


def test_off_topic_and_unkeyed_records_are_planted_as_asked(verify):
    mix = tasks.NoiseMix(wrong_answer=0.1, off_topic=0.1)
    pool = tasks.raw_pool(300, seed=5, noise=mix, unkeyed_share=0.5)
    counts = Counter(_kind(r) or "clean" for r in pool)
    assert counts["off_topic"] == 30 and counts["wrong_answer"] == 30
    unkeyed = [r for r in pool if "withheld_key" in r["meta"]]
    assert 100 < len(unkeyed) < 200  # about half, drawn at random
    for record in unkeyed:
        assert "answer" not in record["meta"] and "verifier" not in record["meta"]
    for record in pool:
        if _kind(record) == "off_topic":
            key = record["meta"].get("withheld_key") or record["meta"]
            assert record["response"] != key["answer"]
    # Without the new options the pool is what it always was.
    assert tasks.raw_pool(300, seed=5) == tasks.raw_pool(300, seed=5, unkeyed_share=0.0)
