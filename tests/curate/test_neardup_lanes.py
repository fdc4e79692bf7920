"""The near-dup stage's one default configuration on short and long texts, and the one-permutation MinHash under it.

Short texts (15-40 words of real documentation, two words edited) must be caught; long texts (100+
words) are compared with exact Jaccard of 5-word shingles, the rule their lane uses; the figures are
measured here, never taken from a file.
"""

from __future__ import annotations

import random
from itertools import combinations

import numpy as np
import pytest

from posttrain.config import load_config
from posttrain.curate.calibrate import _EDITABLE, load_calibration_set, normalized_rows, plant_word_edits
from posttrain.curate.config import CurateRecipe, NearDedupConfig
from posttrain.curate.corpus import families, jaccard, planted_corpus, precision_recall, shingle_set
from posttrain.curate.dedup import NearDedupStage
from posttrain.curate.minhash import MinHasher, connected_components
from posttrain.curate.rows import Row

LONG_TEXT_WORDS = NearDedupConfig().long_text_words


def rows_of(texts: list[str]) -> list[Row]:
    return [Row(i, "t", i + 1, f"r{i}", [{"role": "user", "content": t}, {"role": "assistant", "content": "."}])
            for i, t in enumerate(texts)]  # fmt: skip


def run_stage(rows: list[Row], config: NearDedupConfig, tmp_path, shards: int = 1) -> np.ndarray:
    stage = NearDedupStage(config)
    tmp_path.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(rows), shards + 1).astype(int)
    features = [stage.features(rows[a:b], str(tmp_path / f"s{a}")) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    stage.decide(features, np.ones(len(rows), dtype=bool), [r.id for r in rows])
    return stage.verified_pairs


def test_two_word_edits_of_short_real_answers_are_caught(tmp_path):
    records = load_calibration_set()
    recipe = load_config(CurateRecipe, None, ["data.input=calibration", "output_dir=unused"])
    rng = random.Random(1)
    vocabulary = sorted({w.lower() for r in records for w in _EDITABLE.findall(r["response"]) if 3 <= len(w) <= 10})
    chosen = [i for i, r in enumerate(records) if 15 <= len(r["response"].split()) <= 40]
    assert len(chosen) >= 100
    edits = [{**records[i], "id": f"{records[i]['id']}#e", "response": plant_word_edits(records[i]["response"], rng, vocabulary)}
             for i in chosen]  # fmt: skip
    rows = normalized_rows(records + edits, recipe)
    pairs = run_stage(rows, recipe.near_dedup, tmp_path)
    labels = connected_components(len(rows), pairs)
    recall = float((labels[len(records) :] == labels[chosen]).mean())
    family = np.array(list(range(len(records))) + chosen)
    precision = float((family[pairs[:, 0]] == family[pairs[:, 1]]).mean())
    assert recall >= 0.9 and precision >= 0.95, (recall, precision)


@pytest.fixture(scope="module")
def long_corpus():
    return planted_corpus(1500, seed=4, min_words=100, max_words=300)


def test_long_texts_match_exact_word_shingle_jaccard_with_the_defaults(long_corpus, tmp_path):
    config = NearDedupConfig(fields="prompt")
    pairs = {(int(a), int(b)) for a, b in run_stage(rows_of(long_corpus.docs), config, tmp_path)}
    # Texts outside a planted copy family share no 5-word shingle (random words), so the pairs worth
    # checking are the reported ones and those inside a family.
    evaluated = set(pairs)
    for members in families(len(long_corpus.docs), long_corpus.planted):
        evaluated.update(combinations(sorted(members), 2))
    shingles = {i: shingle_set(long_corpus.docs[i]) for pair in evaluated for i in pair}
    truth = {(a, b) for a, b in evaluated if jaccard(shingles[a], shingles[b]) >= config.threshold}
    assert len(truth) > 150  # the corpus really has near-duplicates to find
    precision, recall = precision_recall(pairs, truth)
    assert recall >= 0.97 and precision >= 0.97, (recall, precision)


def test_result_is_deterministic_and_independent_of_sharding(long_corpus, tmp_path):
    docs = long_corpus.docs[:500] + planted_corpus(500, seed=9, min_words=15, max_words=90).docs  # both lanes
    rows = rows_of(docs)
    config = NearDedupConfig(fields="prompt")
    one = run_stage(rows, config, tmp_path / "a")
    assert one.shape[0] > 50
    np.testing.assert_array_equal(one, run_stage(rows, config, tmp_path / "b", shards=3))


def test_pairs_across_the_length_border_are_found(tmp_path):
    rng = np.random.default_rng(0)
    vocab = [f"tok{i}" for i in range(5000)]
    base = [vocab[i] for i in rng.integers(0, 5000, LONG_TEXT_WORDS - 2)]
    longer = base[:40] + ["extra", "words", "here"] + base[40:]  # 98 → 101 words: one text in each length band
    short = [vocab[i] for i in rng.integers(0, 5000, 30)]
    short_edit = short[:10] + ["changed"] + short[11:]
    texts = [" ".join(base), " ".join(longer), " ".join(short), " ".join(short_edit), " ".join(vocab[:120])]
    pairs = run_stage(rows_of(texts), NearDedupConfig(fields="prompt"), tmp_path)
    assert {tuple(p) for p in pairs.tolist()} == {(0, 1), (2, 3)}


def test_long_texts_are_shingled_by_words_and_short_ones_by_characters():
    hasher = MinHasher(16, 5, seed=0)
    short, long = "alpha beta gamma delta", " ".join(f"w{i}" for i in range(150))
    lanes = hasher.sign_by_length([short, long, ""], long_words=100, overlap_from=63)
    assert lanes["chars"][0].tolist() == [0, 2] and lanes["words"][0].tolist() == [1]
    _, _, values, offsets = lanes["words"]
    assert offsets.tolist() == [0, 146]  # 150 words → 146 five-word shingles
    _, chars, _, char_offsets = lanes["chars"]
    assert char_offsets.tolist() == [0, len(short) - 4, len(short) - 4] and (chars[1] == 0xFFFFFFFF).all()


def test_both_lanes_are_independent_of_the_batch_size():
    rng = random.Random(3)
    words = [f"w{i}" for i in range(300)]
    texts = [" ".join(rng.choices(words, k=rng.choice([3, 20, 70, 90, 150, 260]))) for _ in range(60)] + [""]
    rng.shuffle(texts)
    lanes = [MinHasher(32, 5, seed=1, batch_bytes=size).sign_by_length(texts, 100, 63) for size in (50, 900, 1 << 20)]
    assert lanes[0]["chars"][0].size and lanes[0]["words"][0].size and lanes[0]["chars"][0].size < len(texts)
    for other in lanes[1:]:
        for lane in ("chars", "words"):
            for ours, theirs in zip(lanes[0][lane], other[lane], strict=True):
                np.testing.assert_array_equal(ours, theirs)


def test_one_kind_of_shingle_when_asked_and_the_cut_only_with_auto(tmp_path):
    long = " ".join(f"w{i}" for i in range(150))
    for kind, lanes in (("auto", {"chars": [], "words": [0]}), ("chars", {"chars": [0]}), ("words", {"words": [0]})):
        stage = NearDedupStage(NearDedupConfig(fields="prompt", shingle=kind))
        features = stage.features(rows_of([long]), str(tmp_path / kind))
        assert {lane: features[f"{lane}_members"].tolist() for lane in stage.lanes} == lanes, kind
    with pytest.raises(ValueError, match="long_text_words is the shingle=auto length cut"):
        NearDedupConfig(shingle="chars", long_text_words=50)
    cut = NearDedupStage(NearDedupConfig(fields="prompt", long_text_words=200))  # 150 words is short now
    assert cut.features(rows_of([long]), str(tmp_path / "cut"))["chars_members"].tolist() == [0]


def test_one_permutation_signature_agreement_is_unbiased_for_small_sets():
    """Densified bins must agree with probability Jaccard, also when most bins are empty."""
    hasher, rng = MinHasher(112, seed=3), np.random.default_rng(0)
    estimates = []
    for _ in range(400):  # sets of 10 hashes sharing 6: Jaccard 6 / 14
        shared, only = rng.integers(0, 2**32, 6, dtype=np.uint64), rng.integers(0, 2**32, 8, dtype=np.uint64)
        a, b = np.concatenate((shared, only[:4])), np.concatenate((shared, only[4:]))
        sig = hasher.signatures_from_shingles(np.concatenate((a, b)), np.array([10, 10]))
        estimates.append((sig[0] == sig[1]).mean())
    assert abs(float(np.mean(estimates)) - 6 / 14) < 0.02
    one = hasher.signatures_from_shingles(np.array([12345], dtype=np.uint64), np.array([1]))
    assert (one == one[0, 0]).all() and one[0, 0] != 0xFFFFFFFF  # a single shingle fills every bin
