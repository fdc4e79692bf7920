"""Stages 3-5, deduplication: exact, near-duplicate (MinHash LSH) and semantic (embeddings).

Deduplication needs a global view, so each stage has two halves:

- ``features(rows, scratch)`` runs in the workers, shard by shard, and returns compact arrays per
  row (a 64-bit hash, a ``uint32`` MinHash signature, or an embedding); bulky data the parent only
  needs for a few rows (shingle sets) goes to files under the ``scratch`` prefix instead;
- ``decide(shard_features, alive, ids)`` runs once in the parent over all shards (in input order)
  and returns which rows to drop, with the reason and the id of the row each one duplicates.
  ``alive`` masks out rows an earlier global stage already dropped.

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

from posttrain.curate.config import (
    CurateRecipe,
    EmbeddingConfig,
    ExactDedupConfig,
    NearDedupConfig,
    SemanticDedupConfig,
)
from posttrain.curate.minhash import (
    MinHasher,
    connected_components,
    exact_jaccard,
    near_duplicate_clusters,
    sorted_unique,
    unique_pairs,
)
from posttrain.curate.registry import CURATION_STAGES
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

    def features(self, rows: list[Row], scratch: str) -> np.ndarray:
        return exact_hashes([row.text(self.config.fields) for row in rows])

    def decide(self, shard_features: list[np.ndarray], alive: np.ndarray, ids: Sequence[str]) -> Decisions:
        decisions = Decisions()
        positions = np.flatnonzero(alive)
        if positions.size == 0:
            return decisions
        hashes = np.concatenate(shard_features)[positions]
        _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
        original = positions[first[inverse]]  # the first alive row with the same hash
        for position, source in zip(positions, original, strict=True):
            if source != position:
                decisions.drops[int(position)] = Drop("exact_duplicate", f"same text as {ids[source]}")
        return decisions


class ShingleSets:
    """Each row's shingle hashes, read lazily from the workers' per-shard files (``prefix`` picks which set)."""

    def __init__(self, shard_features: list[dict[str, Any]], prefix: str = ""):
        self.files = [(np.load(f[f"{prefix}values"], mmap_mode="r"), np.load(f[f"{prefix}offsets"])) for f in shard_features]
        self.starts = np.cumsum([0] + [len(offsets) - 1 for _, offsets in self.files])

    def __call__(self, position: int) -> np.ndarray:
        shard = int(np.searchsorted(self.starts, position, side="right")) - 1
        values, offsets = self.files[shard]
        local = position - int(self.starts[shard])
        return np.asarray(values[offsets[local] : offsets[local + 1]])

    def many(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sets of ``positions`` (ascending) concatenated, and their sizes: one gather per shard file, not
        a Python call per row (``minhash.exact_jaccard`` uses it; 7 000 rows of 30 000 are verified there)."""
        shards = np.searchsorted(self.starts, positions, side="right") - 1
        parts, sizes = [np.zeros(0, np.uint32)], [np.zeros(0, np.int64)]
        for shard in sorted_unique(shards):
            values, offsets = self.files[shard]
            local = positions[shards == shard] - self.starts[shard]
            begin, lengths = offsets[local], offsets[local + 1] - offsets[local]
            within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            parts.append(np.asarray(values[np.repeat(begin, lengths) + within], dtype=np.uint32))
            sizes.append(lengths.astype(np.int64))
        return np.concatenate(parts), np.concatenate(sizes)




class NearDedupStage:
    """MinHash LSH over each row's text (``fields``), candidates verified on shingle-set Jaccard.

    Shingles depend on length under ``shingle: auto`` (the default). A text of fewer than
    ``long_text_words`` (100) words is shingled by characters, which see a two-word edit of a short
    answer; a longer one by ``shingle_size``-word shingles, which see the same edit of a long text at
    a sixth of the cost (about 1 shingle a word instead of 6). The two are *lanes*: each has its own
    signatures, LSH buckets and exact Jaccard, and a pair is a duplicate when it reaches
    ``threshold`` in either lane it shares. Texts of ``threshold·0.9·100`` (63) to 99 words are in
    both lanes, so no pair is lost at the border: two texts with Jaccard ≥ ``threshold`` have set
    sizes within a factor ``threshold``, so when one has 100 words or more the other has at least
    ~70 and is in the word lane too. ``shingle: words`` is one lane of word shingles for every length,
    ``shingle: chars`` one of character shingles (the slow way for long texts, kept for comparison).

    With ``fields: both`` and ``min_prompt_jaccard`` set, a verified pair must also have prompts
    whose ``prompt_shingle_size``-*word* shingle sets reach that Jaccard. Character shingles make a
    two-word edit of a short answer a near-duplicate, but they also make templated tasks one:
    "… This one is about 13 and 1. What is 13 - 1?" and "… about 20 and 5. What is 20 - 5?" differ in
    a few characters of a long shared preamble. Over words, a changed number or name changes every
    shingle it is in, so distinct tasks stay apart while an edited answer to the same question does not.
    """

    name = "near_dedup"

    def __init__(self, config: NearDedupConfig):
        self.config = config
        self.hasher = MinHasher(config.num_perm, config.shingle_size, config.seed, shingle="words")
        # auto: two lanes cut by length; chars: the character lane for every length (no text is "long")
        self.by_length = config.shingle != "words"
        self.lanes = {"auto": ("chars", "words"), "chars": ("chars",), "words": ("words",)}[config.shingle]
        self.long_words = config.long_text_words if config.shingle == "auto" else np.iinfo(np.int64).max
        self.overlap_from = (int(config.long_text_words * config.threshold * 0.9) if config.shingle == "auto"
                             else np.iinfo(np.int64).max)
        self.verified_pairs = np.zeros((0, 2), dtype=np.int64)
        self.check_prompts = config.fields == "both" and config.min_prompt_jaccard is not None
        # Word shingles of the prompts, for the prompt check only (the one bin is never used).
        self.prompt_hasher = (MinHasher(1, config.prompt_shingle_size, config.seed, shingle="words")
                              if self.check_prompts else None)

    def features(self, rows: list[Row], scratch: str) -> dict[str, Any]:
        exact = self.config.verify == "exact"
        texts = [row.text(self.config.fields) for row in rows]
        if self.by_length:
            lanes = self.hasher.sign_by_length(texts, self.long_words, self.overlap_from, exact)
            lanes = {lane: lanes[lane] for lane in self.lanes}
        else:
            lanes = {"words": (np.arange(len(texts)), *self.hasher.sign(texts, exact))}
        features: dict[str, Any] = {"rows": len(rows)}
        for lane, (members, signatures, values, offsets) in lanes.items():
            features.update({f"{lane}_members": members, f"{lane}_signatures": signatures})
            if exact:
                np.save(f"{scratch}-{lane}-shingles.npy", values)
                np.save(f"{scratch}-{lane}-offsets.npy", offsets)
                features.update({f"{lane}_values": f"{scratch}-{lane}-shingles.npy",
                                 f"{lane}_offsets": f"{scratch}-{lane}-offsets.npy"})  # fmt: skip
        if self.check_prompts:
            values, offsets = self.prompt_hasher.shingle_sets([row.prompt for row in rows])
            np.save(f"{scratch}-prompt-shingles.npy", values)
            np.save(f"{scratch}-prompt-offsets.npy", offsets)
            features.update(prompt_values=f"{scratch}-prompt-shingles.npy", prompt_offsets=f"{scratch}-prompt-offsets.npy")
        return features

    def decide(self, shard_features: list[dict[str, Any]], alive: np.ndarray, ids: Sequence[str]) -> Decisions:
        decisions = Decisions()
        if alive.sum() < 2:
            return decisions
        shard_starts = np.cumsum([0] + [f["rows"] for f in shard_features])[:-1]
        prompt_check = None
        if self.check_prompts:
            prompts, floor = ShingleSets(shard_features, "prompt_"), self.config.min_prompt_jaccard

            def prompt_check(pairs: np.ndarray) -> np.ndarray:
                return exact_jaccard(pairs, prompts) >= floor

        found = [np.zeros((0, 2), dtype=np.int64)]
        for lane in self.lanes:
            # Lane row → position in the concatenated input.
            positions = np.concatenate([start + f[f"{lane}_members"] for start, f in zip(shard_starts, shard_features, strict=True)])
            if positions.size < 2:
                continue
            signatures = np.concatenate([f[f"{lane}_signatures"] for f in shard_features])
            valid = alive[positions] & (signatures[:, 0] != np.uint32(0xFFFFFFFF))  # a text without words matches nothing
            keep_pair = None if prompt_check is None else (lambda pairs, at=positions: prompt_check(at[pairs]))
            _, pairs = near_duplicate_clusters(
                signatures,
                self.config.bands,
                self.config.rows,
                self.config.threshold,
                verify=self.config.verify,
                shingle_set_of=ShingleSets(shard_features, f"{lane}_") if self.config.verify == "exact" else None,
                valid=valid,
                max_bucket=self.config.max_bucket,
                keep_pair=keep_pair,
            )
            found.append(positions[pairs])
        pairs = unique_pairs(np.concatenate(found), alive.size)
        labels = connected_components(alive.size, pairs)
        self.verified_pairs = pairs  # kept for reports and benchmarks
        for position in sorted_unique(pairs.ravel()):
            representative = int(labels[position])
            decisions.annotations[int(position)] = {"near_dup_cluster": ids[representative]}
            if representative != position:
                decisions.drops[int(position)] = Drop("near_duplicate", f"cluster of {ids[representative]}")
        return decisions


def similar_pairs(embeddings: np.ndarray, threshold: float, block_size: int = 4096) -> np.ndarray:
    """All pairs ``(i, j)``, ``i < j``, with cosine ≥ threshold, by blockwise matrix products.

    Exact and ``O(n²·d)``: fine up to ~10⁵ rows on CPU; beyond that, cluster first or use an ANN index.
    """
    pieces = [np.zeros((0, 2), dtype=np.int64)]
    for start in range(0, embeddings.shape[0], block_size):
        block = embeddings[start : start + block_size]
        sims = block @ embeddings[: start + block.shape[0]].T  # rows of this block vs all earlier rows
        rows, cols = np.nonzero(sims >= threshold)
        rows = rows + start
        keep = cols < rows
        pieces.append(np.stack((cols[keep], rows[keep]), axis=1))
    return np.concatenate(pieces)


class SemanticDedupStage:
    name = "semantic_dedup"

    def __init__(self, config: SemanticDedupConfig, embedding: EmbeddingConfig):
        self.config, self.embedding = config, embedding

    def features(self, rows: list[Row], scratch: str) -> np.ndarray:
        from posttrain.curate.embed import embed_texts

        texts = [row.text(self.config.fields) for row in rows]
        return embed_texts(texts, self.embedding.model, self.embedding.batch_size, self.embedding.max_length)

    def decide(self, shard_features: list[np.ndarray], alive: np.ndarray, ids: Sequence[str]) -> Decisions:
        decisions = Decisions()
        positions = np.flatnonzero(alive)
        if positions.size < 2:
            return decisions
        embeddings = np.concatenate(shard_features)[positions]
        pairs = similar_pairs(embeddings, self.config.threshold, self.config.block_size)
        labels = connected_components(positions.size, pairs)
        for local in np.flatnonzero(labels != np.arange(labels.size)):
            representative = positions[labels[local]]
            decisions.drops[int(positions[local])] = Drop("semantic_duplicate", f"cluster of {ids[representative]}")
        return decisions


@CURATION_STAGES.register("exact_dedup")
def _exact_dedup_stage(recipe: CurateRecipe, cache_dir: str | None) -> ExactDedupStage:
    return ExactDedupStage(recipe.exact_dedup)


@CURATION_STAGES.register("near_dedup")
def _near_dedup_stage(recipe: CurateRecipe, cache_dir: str | None) -> NearDedupStage:
    return NearDedupStage(recipe.near_dedup)


@CURATION_STAGES.register("semantic_dedup")
def _semantic_dedup_stage(recipe: CurateRecipe, cache_dir: str | None) -> SemanticDedupStage:
    return SemanticDedupStage(recipe.semantic_dedup, recipe.embedding)
