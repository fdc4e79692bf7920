"""MinHash signatures, LSH banding and clustering against exact Jaccard ground truth."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.curate.corpus import (
    candidate_pairs_sharing_a_shingle,
    jaccard,
    planted_corpus,
    precision_recall,
    shingle_set,
    true_pairs,
)
from posttrain.curate.minhash import (
    MinHasher,
    connected_components,
    lsh_candidate_pairs,
    near_duplicate_clusters,
    signature_agreement,
)


@pytest.fixture(scope="module")
def corpus():
    planted = planted_corpus(3000, seed=1)
    shingles = [shingle_set(doc) for doc in planted.docs]
    truth = true_pairs(shingles, candidate_pairs_sharing_a_shingle(shingles), 0.8)
    return planted, shingles, truth


def test_signatures_are_deterministic_and_seeded():
    texts = ["the quick brown fox jumps over the lazy dog again and again", "a completely different text here"]
    first = MinHasher(seed=0).signatures(texts)
    assert first.shape == (2, 112) and first.dtype == np.uint32
    np.testing.assert_array_equal(first, MinHasher(seed=0).signatures(texts))
    assert not np.array_equal(first, MinHasher(seed=1).signatures(texts))


def test_signature_of_a_text_does_not_depend_on_its_batch():
    corpus = planted_corpus(200, seed=5).docs
    alone = np.stack([MinHasher(batch_bytes=1 << 20).signatures([text])[0] for text in corpus[:20]])
    batched = MinHasher(batch_bytes=700).signatures(corpus)[:20]
    np.testing.assert_array_equal(alone, batched)


def test_case_and_punctuation_do_not_change_the_signature():
    hasher = MinHasher()
    a, b = hasher.signatures(["Hello, World! This is a test of it.", "hello world this is a test of it"])
    np.testing.assert_array_equal(a, b)


def test_short_and_empty_texts():
    hasher = MinHasher()
    sig = hasher.signatures(["", "   ...  ", "two words", "two words", "other words"])
    assert (sig[0] == 0xFFFFFFFF).all() and (sig[1] == 0xFFFFFFFF).all()
    np.testing.assert_array_equal(sig[2], sig[3])
    assert (sig[2] != sig[4]).mean() > 0.9
    for alone in (["one"], ["one two"], ["0 0"]):  # fewer words than a shingle, alone in a batch
        assert (hasher.signatures(alone) != 0xFFFFFFFF).all()


def test_shingle_sets_match_exact_shingles(corpus):
    planted, shingles, _ = corpus
    _, values, offsets = MinHasher().sign(planted.docs[:300])
    sizes = [np.unique(values[offsets[i] : offsets[i + 1]]).size for i in range(300)]
    assert sizes == [len(s) for s in shingles[:300]]


def test_agreement_estimates_jaccard(corpus):
    planted, shingles, _ = corpus
    signatures = MinHasher().signatures(planted.docs)
    pairs = np.array([(a, b) for a, b, _ in planted.planted])
    exact = np.array([jaccard(shingles[a], shingles[b]) for a, b in pairs])
    estimate = signature_agreement(signatures, pairs)
    # Unbiased with standard deviation sqrt(J(1-J)/112) <= 0.047.
    assert abs(float(np.mean(estimate - exact))) < 0.01
    assert float(np.mean(np.abs(estimate - exact))) < 0.04


def test_near_duplicates_recall_and_precision_against_exact_jaccard(corpus):
    planted, _, truth = corpus
    assert len(truth) > 200  # the corpus really has near-duplicates to find
    signatures, values, offsets = MinHasher(num_perm=112, shingle_size=5).sign(planted.docs)
    _, pairs = near_duplicate_clusters(
        signatures, 14, 8, 0.8, verify="exact", shingle_set_of=lambda i: values[offsets[i] : offsets[i + 1]]
    )
    precision, recall = precision_recall({(int(a), int(b)) for a, b in pairs}, truth)
    assert recall >= 0.95 and precision >= 0.95, (recall, precision)


def test_unverified_lsh_lets_hard_negatives_through(corpus):
    """The planted heavy edits (Jaccard 0.4-0.8) are why candidates need verification."""
    planted, _, truth = corpus
    signatures = MinHasher().signatures(planted.docs)
    _, pairs = near_duplicate_clusters(signatures, 14, 8, 0.8, verify="none")
    precision, recall = precision_recall({(int(a), int(b)) for a, b in pairs}, truth)
    assert recall >= 0.95 and precision < 0.95


def test_candidate_pairs_match_brute_force_banding():
    rng = np.random.default_rng(0)
    signatures = rng.integers(0, 3, size=(60, 12), dtype=np.uint32)  # tiny alphabet: many collisions
    found = {tuple(map(int, p)) for p in lsh_candidate_pairs(signatures, bands=4, rows=3)}
    expected = {
        (i, j)
        for i in range(60)
        for j in range(i + 1, 60)
        if any((signatures[i, b * 3 : b * 3 + 3] == signatures[j, b * 3 : b * 3 + 3]).all() for b in range(4))
    }
    assert found == expected


def test_connected_components_matches_union_find():
    rng = np.random.default_rng(1)
    n = 300
    pairs = np.sort(rng.integers(0, n, size=(250, 2)), axis=1)
    parent = list(range(n))

    def root(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = root(int(a)), root(int(b))
        parent[max(ra, rb)] = min(ra, rb)
    labels = connected_components(n, pairs)
    for node in range(n):
        members = [m for m in range(n) if root(m) == root(node)]
        assert labels[node] == min(members)


def _reference_word_hashes(texts: list[str], base: int) -> tuple[list[int], list[int]]:
    """``word_hashes`` one word at a time in Python ints: words are runs of bytes of the lower-cased UTF-8 text
    other than ASCII whitespace, punctuation and control bytes; a word hashes to splitmix64(Σ (b_i + 1)·base^i)."""
    separators = set(b" \t\n\r\x0b\x0c!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") | set(range(32))
    mask = (1 << 64) - 1

    def splitmix64(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    hashes, counts = [], []
    for text in texts:
        words = [[]]
        for byte in text.lower().encode("utf-8", "surrogatepass"):
            if byte in separators:
                words.append([])
            else:
                words[-1].append(byte)
        words = [word for word in words if word]
        counts.append(len(words))
        hashes += [splitmix64(sum((b + 1) * pow(base, i, 1 << 64) for i, b in enumerate(word)) & mask) for word in words]
    return hashes, counts


def test_word_hashes_are_each_word_s_polynomial_hash():
    texts = ["The quick, brown fox!", "", "   ...  ", "DEL\x7fin a word", "tab\tand\nnew line\x00nul",
             "ünïcödé Wörter — 漢字 text", "emoji 😀 and a lone \ud800 surrogate", "a" * 300 + " b",
             "ends with a separator.", "x"]  # fmt: skip
    hasher = MinHasher(batch_bytes=64)  # small batches: words of several texts and batches
    for batch in (texts, texts[3:4], texts[:1]):
        hashes, counts = hasher.word_hashes(batch)
        expected, expected_counts = _reference_word_hashes(batch, int(hasher._base))
        assert counts.tolist() == expected_counts
        assert hashes.tolist() == expected


def test_exact_jaccard_reads_sets_in_bulk_from_shard_files_as_it_does_one_by_one(tmp_path):
    from posttrain.curate.dedup import ShingleSets
    from posttrain.curate.minhash import exact_jaccard

    rng = np.random.default_rng(3)
    sets, features = [], []
    for shard, rows in enumerate((7, 0, 12, 5)):  # an empty shard, and empty sets, too
        parts = [rng.integers(0, 40, size=int(rng.integers(0, 30)), dtype=np.uint32) for _ in range(rows)]
        sets += parts
        np.save(tmp_path / f"v{shard}.npy", np.concatenate(parts) if parts else np.zeros(0, np.uint32))
        np.save(tmp_path / f"o{shard}.npy", np.concatenate(([0], np.cumsum([len(p) for p in parts]))).astype(np.int64))
        features.append({"x_values": str(tmp_path / f"v{shard}.npy"), "x_offsets": str(tmp_path / f"o{shard}.npy")})
    files = ShingleSets(features, "x_")
    assert hasattr(files, "many")
    pairs = np.array([(i, j) for i in range(len(sets)) for j in range(i + 1, len(sets))])
    bulk = exact_jaccard(pairs, files, chunk_values=200)
    one_by_one = exact_jaccard(pairs, lambda i: sets[i])
    np.testing.assert_array_equal(bulk, one_by_one)
    expected = [len(set(sets[i].tolist()) & set(sets[j].tolist())) / max(len(set(sets[i].tolist()) | set(sets[j].tolist())), 1)
                for i, j in pairs]  # fmt: skip
    np.testing.assert_allclose(bulk, expected)
