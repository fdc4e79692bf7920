"""Stage 7, intent classification: one label per record from a configurable label set.

``embedding`` method: nearest centroid. Each label's centroid is the normalised mean embedding of
its few example prompts; a record gets the label whose centroid has the highest cosine with its
prompt embedding, or ``other`` below ``min_similarity`` (a prototype classifier, as in Snell et al.
2017, "Prototypical Networks for Few-shot Learning"). ``judge`` method: the label the judge gave.
"""

from __future__ import annotations

import numpy as np

from posttrain.curate.config import CurateRecipe, EmbeddingConfig, IntentConfig
from posttrain.curate.registry import CURATION_STAGES
from posttrain.curate.rows import Drop, Row

OTHER = "other"


def centroids(label_embeddings: dict[str, np.ndarray]) -> tuple[list[str], np.ndarray]:
    """``(labels, [n_labels, dim])``: each label's unit-length mean embedding."""
    labels = list(label_embeddings)
    means = np.stack([label_embeddings[label].mean(axis=0) for label in labels])
    return labels, means / np.linalg.norm(means, axis=1, keepdims=True).clip(min=1e-12)


def nearest_centroid(
    embeddings: np.ndarray, labels: list[str], centers: np.ndarray, min_similarity: float
) -> tuple[list[str], np.ndarray]:
    """Label and cosine of the nearest centroid per row; ``other`` when the cosine is below the floor."""
    sims = embeddings @ centers.T
    best = sims.argmax(axis=1)
    score = sims[np.arange(sims.shape[0]), best]
    return [labels[b] if s >= min_similarity else OTHER for b, s in zip(best, score, strict=True)], score


class IntentStage:
    name = "intent"

    def __init__(self, config: IntentConfig, embedding: EmbeddingConfig):
        self.config, self.embedding = config, embedding
        self._centroids: tuple[list[str], np.ndarray] | None = None

    def _embed(self, texts: list[str]) -> np.ndarray:
        from posttrain.curate.embed import embed_texts

        return embed_texts(texts, self.embedding.model, self.embedding.batch_size, self.embedding.max_length)

    def labels_for(self, rows: list[Row]) -> tuple[list[str], list[float | None]]:
        if self.config.method == "judge":
            labels = [row.scores.get("judge_intent") or OTHER for row in rows]
            return [label if label in self.config.labels else OTHER for label in labels], [None] * len(rows)
        if self._centroids is None:
            examples = {label: self._embed(texts) for label, texts in self.config.labels.items()}
            self._centroids = centroids(examples)
        labels, centers = self._centroids
        found, score = nearest_centroid(self._embed([row.prompt for row in rows]), labels, centers,
                                        self.config.min_similarity)  # fmt: skip
        return found, [round(float(s), 4) for s in score]

    def apply(self, rows: list[Row]) -> list[Drop | None]:
        if not rows:
            return []
        labels, similarity = self.labels_for(rows)
        results: list[Drop | None] = []
        for row, label, sim in zip(rows, labels, similarity, strict=True):
            row.intent = label
            if sim is not None:
                row.scores["intent_similarity"] = sim
            results.append(Drop("intent_excluded", label) if label in self.config.drop_labels else None)
        return results


@CURATION_STAGES.register("intent")
def _intent_stage(recipe: CurateRecipe, cache_dir: str | None) -> IntentStage:
    return IntentStage(recipe.intent, recipe.embedding)
