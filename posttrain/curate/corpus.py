"""A synthetic corpus with planted near-duplicates and exact-Jaccard ground truth, for the near-dup
test and benchmark.

Documents are random word sequences over a Zipf-distributed vocabulary of made-up words. A share
of them are edited copies of earlier documents: ``near`` copies get a few word substitutions,
insertions and deletions (Jaccard of 5-word shingles mostly 0.8-1.0); ``hard`` copies get many
(mostly 0.4-0.8), so a detector that reports every pair that looks vaguely alike loses precision.
Ground truth is exact Jaccard on the same shingles the MinHasher uses (lower-cased words split at
ASCII whitespace and punctuation), never a MinHash estimate.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

_SPLIT = re.compile(r"[\s!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~\x00-\x1f]+")


def shingle_set(text: str, k: int = 5) -> set[tuple[str, ...]]:
    """The shingles MinHasher hashes: k-word windows (one shingle of all words if fewer than k)."""
    tokens = [t for t in _SPLIT.split(text.lower()) if t]
    if not tokens:
        return set()
    if len(tokens) < k:
        return {tuple(tokens)}
    return {tuple(tokens[i : i + k]) for i in range(len(tokens) - k + 1)}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


@dataclass
class PlantedCorpus:
    docs: list[str]
    planted: list[tuple[int, int, str]]  # (source, copy, kind) with source < copy


def _vocabulary(rng: np.random.Generator, size: int) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = rng.integers(2, 10, size=size)
    words = {"".join(rng.choice(letters, size=n)) for n in lengths}
    return sorted(words)


def _edit(tokens: list[str], edits: int, vocab: Sequence[str], rng: np.random.Generator) -> list[str]:
    tokens = list(tokens)
    for _ in range(edits):
        position = int(rng.integers(0, len(tokens)))
        kind = rng.integers(0, 3)
        word = vocab[int(rng.integers(0, len(vocab)))]
        if kind == 0:
            tokens[position] = word
        elif kind == 1:
            tokens.insert(position, word)
        elif len(tokens) > 10:
            del tokens[position]
    return tokens


def planted_corpus(
    n_docs: int,
    seed: int = 0,
    near_fraction: float = 0.1,
    hard_fraction: float = 0.05,
    min_words: int = 60,
    max_words: int = 250,
    vocab_size: int = 20_000,
) -> PlantedCorpus:
    """``n_docs`` documents; ``near_fraction`` are light edits of earlier ones, ``hard_fraction`` heavy edits."""
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng, vocab_size)
    weights = 1.0 / np.arange(1, len(vocab) + 1) ** 0.8
    cdf = np.cumsum(weights / weights.sum())
    kinds = rng.choice(3, size=n_docs, p=[1 - near_fraction - hard_fraction, near_fraction, hard_fraction])
    kinds[0] = 0
    token_lists: list[list[str]] = []
    planted: list[tuple[int, int, str]] = []
    for index, kind in enumerate(kinds):
        if kind == 0 or index == 0:
            length = int(rng.integers(min_words, max_words + 1))
            picks = np.minimum(np.searchsorted(cdf, rng.random(length)), len(vocab) - 1)
            token_lists.append([vocab[i] for i in picks])
            continue
        source = int(rng.integers(0, index))
        base = token_lists[source]
        # Each edit breaks up to 5 shingles: about L/100 edits keeps Jaccard near 0.9, L/12 near 0.5.
        if kind == 1:
            edits = int(rng.integers(0, max(2, len(base) // 40) + 1))
        else:
            edits = int(rng.integers(len(base) // 25, len(base) // 8 + 1))
        token_lists.append(_edit(base, edits, vocab, rng))
        planted.append((source, index, "near" if kind == 1 else "hard"))
    docs = [" ".join(tokens) for tokens in token_lists]
    return PlantedCorpus(docs, planted)


def candidate_pairs_sharing_a_shingle(shingles: Sequence[set]) -> set[tuple[int, int]]:
    """Every pair of documents with at least one shingle in common (all others have Jaccard 0)."""
    postings: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for doc, doc_shingles in enumerate(shingles):
        for shingle in doc_shingles:
            postings[shingle].append(doc)
    pairs: set[tuple[int, int]] = set()
    for docs in postings.values():
        if 1 < len(docs) <= 200:  # a shingle in hundreds of docs is boilerplate; none are in this corpus
            for i, a in enumerate(docs):
                for b in docs[i + 1 :]:
                    pairs.add((a, b))
    return pairs


def families(n_docs: int, planted: Sequence[tuple[int, int, str]]) -> list[list[int]]:
    """Groups of documents linked by planted copying (a source, its copies, their copies)."""
    parent = list(range(n_docs))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for source, copy, _ in planted:
        parent[root(copy)] = root(source)
    groups: dict[int, list[int]] = defaultdict(list)
    for doc in range(n_docs):
        groups[root(doc)].append(doc)
    return [members for members in groups.values() if len(members) > 1]


def true_pairs(shingles: Sequence[set], pairs: Iterable[tuple[int, int]], threshold: float) -> set[tuple[int, int]]:
    return {(a, b) for a, b in pairs if jaccard(shingles[a], shingles[b]) >= threshold}


def precision_recall(predicted: set[tuple[int, int]], truth: set[tuple[int, int]]) -> tuple[float, float]:
    hits = len(predicted & truth)
    precision = hits / len(predicted) if predicted else 1.0
    recall = hits / len(truth) if truth else 1.0
    return precision, recall
