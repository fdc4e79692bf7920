"""Stages 3-5, deduplication: exact, near-duplicate (MinHash LSH) and semantic (embeddings).

Deduplication needs a global view, so each stage has two halves:

- ``features(rows)`` runs in the workers, shard by shard, and returns a compact array per row
  (a 64-bit hash, a ``uint32`` MinHash signature, or an embedding);
- ``decide(features, ids)`` runs once in the parent over the concatenated arrays (in input order)
  and returns which rows to drop, with the reason and the id of the row each one duplicates.

The first occurrence in input order is always the one kept, so the result does not depend on the
number of workers or the shard size.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from posttrain.curate.config import EmbeddingConfig, ExactDedupConfig, NearDedupConfig, SemanticDedupConfig
from posttrain.curate.minhash import MinHasher, connected_components, near_duplicate_clusters
from posttrain.curate.rows import Drop, Row

_NOT_WORD = re.compile(r"[\W_]+", re.UNICODE)


@dataclass
class Decisions:
    """The parent's verdict for the rows of one global stage, by position in the concatenated arrays."""

    drops: dict[int, Drop] = field(default_factory=dict)
    annotations: dict[int, dict[str, Any]] = field(default_factory=dict)


def exact_key(text: str) -> str:
    """Case-folded text with punctuation and whitespace runs reduced to one space."""
    return _NOT_WORD.sub(" ", text.casefold()).strip()


def exact_hashes(texts: Sequence[str]) -> np.ndarray:
    out = np.empty(len(texts), dtype=np.uint64)
    for position, text in enumerate(texts):
        digest = hashlib.blake2b(exact_key(text).encode("utf-8", "surrogatepass"), digest_size=8).digest()
        out[position] = int.from_bytes(digest, "little")
    return out


class ExactDedupStage:
    name = "exact_dedup"

    def __init__(self, config: ExactDedupConfig):
        self.config = config

    def features(self, rows: list[Row]) -> np.ndarray:
        return exact_hashes([row.text(self.config.fields) for row in rows])

    def decide(self, features: np.ndarray, ids: Sequence[str]) -> Decisions:
        decisions = Decisions()
        if features.size == 0:
            return decisions
        _, first, inverse = np.unique(features, return_index=True, return_inverse=True)
        original = first[inverse]
        for position in np.flatnonzero(original != np.arange(features.size)):
            decisions.drops[int(position)] = Drop("exact_duplicate", f"same text as {ids[original[position]]}")
        return decisions


class NearDedupStage:
    name = "near_dedup"

    def __init__(self, config: NearDedupConfig):
        self.config = config
        self.hasher = MinHasher(config.num_perm, config.shingle_size, config.seed)

    def features(self, rows: list[Row]) -> np.ndarray:
        return self.hasher.signatures([row.text(self.config.fields) for row in rows])

    def decide(self, features: np.ndarray, ids: Sequence[str]) -> Decisions:
        decisions = Decisions()
        if features.shape[0] < 2:
            return decisions
        nonempty = features[:, 0] != np.uint32(0xFFFFFFFF)  # texts without a word never match
        labels, pairs = near_duplicate_clusters(
            features,
            self.config.bands,
            self.config.rows,
            self.config.verify_threshold,
            valid=nonempty,
            max_bucket=self.config.max_bucket,
        )
        in_cluster = np.zeros(labels.size, dtype=bool)
        in_cluster[pairs.ravel()] = True
        for position in np.flatnonzero(in_cluster):
            representative = int(labels[position])
            decisions.annotations[int(position)] = {"near_dup_cluster": ids[representative]}
            if representative != position:
                decisions.drops[int(position)] = Drop("near_duplicate", f"cluster of {ids[representative]}")
        return decisions


def similar_pairs(embeddings: np.ndarray, threshold: float, block_size: int = 4096) -> np.ndarray:
    """All pairs ``(i, j)``, ``i < j``, with cosine ≥ threshold, by blockwise matrix products.

    Exact and ``O(n²·d)``: fine up to ~10⁵ rows on CPU; beyond that, cluster first or use an ANN index.
    """
    pieces = []
    for start in range(0, embeddings.shape[0], block_size):
        block = embeddings[start : start + block_size]
        sims = block @ embeddings[: start + block.shape[0]].T  # rows of this block vs all earlier rows
        rows, cols = np.nonzero(sims >= threshold)
        rows = rows + start
        keep = cols < rows
        pieces.append(np.stack((cols[keep], rows[keep]), axis=1))
    return np.concatenate(pieces) if pieces else np.zeros((0, 2), dtype=np.int64)


class SemanticDedupStage:
    name = "semantic_dedup"

    def __init__(self, config: SemanticDedupConfig, embedding: EmbeddingConfig):
        self.config, self.embedding = config, embedding

    def features(self, rows: list[Row]) -> np.ndarray:
        from posttrain.curate.embed import embed_texts

        texts = [row.text(self.config.fields) for row in rows]
        return embed_texts(texts, self.embedding.model, self.embedding.batch_size, self.embedding.max_length)

    def decide(self, features: np.ndarray, ids: Sequence[str]) -> Decisions:
        decisions = Decisions()
        if features.shape[0] < 2:
            return decisions
        pairs = similar_pairs(features, self.config.threshold, self.config.block_size)
        labels = connected_components(features.shape[0], pairs)
        for position in np.flatnonzero(labels != np.arange(labels.size)):
            representative = int(labels[position])
            decisions.drops[int(position)] = Drop("semantic_duplicate", f"cluster of {ids[representative]}")
        return decisions
