"""Stage ``model_judge``: a trained model as judge — the seed's "smaller models as judges".

Rules catch broken records (filters, dedup), and a verifier catches wrong answers where an answer key
exists. A fluent answer that is wrong, or that answers another question, passes every rule when the
record has no key — most user data has none. A model trained on good data can still tell: such a
response is *unlikely* under it. Two scores are supported:

- ``likelihood``: the mean token log-probability of the response given the prompt under a causal LM,
  typically the previous flywheel round's policy:
  ``s = (1/|y|) · Σ_t log π(y_t | x, y_<t)`` (length-normalised so long answers are not penalised).
- ``reward_model``: the scalar reward of a ``posttrain rm`` model (``posttrain.train.reward_scorer``).

Neither score has an absolute scale that means "good", so the decision is relative to the pool
itself: a record is dropped when its robust z-score ``z = (s - median) / (1.4826 · MAD)`` over the
records still alive is below ``-max_z`` (``robust_z``). The pool is assumed mostly clean — the
stage finds outliers, it does not rank. It is a *global* stage: workers score their shards
(``features``), and the parent decides over every record (``decide``). Each kept or dropped record
carries ``scores["model_judge"]`` and ``scores["model_judge_z"]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from posttrain.curate.config import CurateRecipe, ModelJudgeConfig
from posttrain.curate.dedup import Decisions
from posttrain.curate.registry import CURATION_STAGES
from posttrain.curate.rows import Drop, Row

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution is 0.6745 sigma


def robust_z(values: np.ndarray) -> np.ndarray:
    """``(v - median) / (1.4826 · MAD)``: a z-score that a minority of outliers cannot drag (Iglewicz &
    Hoaglin 1993). A zero MAD (half the values identical) falls back to the mean absolute deviation,
    and to all-zero scores when every value is the same."""
    median = float(np.median(values))
    spread = MAD_TO_SIGMA * float(np.median(np.abs(values - median)))
    if spread == 0.0:
        spread = 1.2533 * float(np.mean(np.abs(values - median)))  # mean abs deviation of a normal = 0.798 sigma
    if spread == 0.0:
        return np.zeros_like(values)
    return (values - median) / spread


class LikelihoodScorer:
    """Mean token log-prob of each response under a causal LM, in batches of ``batch_size``."""

    def __init__(self, config: ModelJudgeConfig):
        from posttrain import dist
        from posttrain.models.load import load_model, load_tokenizer

        self.config = config
        self.tokenizer = load_tokenizer(str(config.model))
        self.model = load_model(str(config.model), device=dist.device()).eval()

    def __call__(self, rows: Sequence[Row]) -> list[float]:
        from posttrain.data.packing import collate_padded
        from posttrain.data.tokenize import tokenize_prompt_completion
        from posttrain.models.logprobs import mean_label_logprobs

        out: list[float] = []
        for start in range(0, len(rows), self.config.batch_size):
            examples = [
                tokenize_prompt_completion(row.context(), [{"role": "assistant", "content": row.response}],
                                           self.tokenizer, self.config.max_length, "left")
                for row in rows[start : start + self.config.batch_size]
            ]
            batch = collate_padded(examples, self.tokenizer.pad_token_id or 0)
            out += mean_label_logprobs(self.model, batch["input_ids"], batch["labels"], batch["attention_mask"])
        return out


class RewardModelScorer:
    def __init__(self, config: ModelJudgeConfig):
        from posttrain.train.reward_scorer import RewardScorer

        self.scorer = RewardScorer.from_path(str(config.model), batch_size=config.batch_size,
                                             max_length=config.max_length)

    def __call__(self, rows: Sequence[Row]) -> list[float]:
        return self.scorer([(row.context(), row.response) for row in rows])


class ModelJudgeStage:
    name = "model_judge"

    def __init__(self, config: ModelJudgeConfig):
        self.config = config
        self._scorer: LikelihoodScorer | RewardModelScorer | None = None

    def scorer(self) -> LikelihoodScorer | RewardModelScorer:
        if self._scorer is None:  # loaded on first use, in the process that scores
            self._scorer = (LikelihoodScorer if self.config.kind == "likelihood" else RewardModelScorer)(self.config)
        return self._scorer

    def features(self, rows: list[Row], scratch: str) -> np.ndarray:
        scored = [i for i, row in enumerate(rows) if row.response.strip()]
        values = np.full(len(rows), np.nan, dtype=np.float64)
        if scored:
            values[scored] = self.scorer()([rows[i] for i in scored])
        return values

    def decide(self, shard_features: list[np.ndarray], alive: np.ndarray, ids: Sequence[str]) -> Decisions:
        decisions = Decisions()
        values = np.concatenate(shard_features) if shard_features else np.zeros(0)
        positions = np.flatnonzero(alive & np.isfinite(values))
        if positions.size < self.config.min_records:
            return decisions
        z = robust_z(values[positions])
        what = "mean token log-prob" if self.config.kind == "likelihood" else "reward"
        for position, score in zip(positions, z, strict=True):
            decisions.annotations[int(position)] = {"model_judge": round(float(values[position]), 4),
                                                    "model_judge_z": round(float(score), 2)}
            if score < -self.config.max_z:
                decisions.drops[int(position)] = Drop(
                    "model_judge_outlier",
                    f"{what} {values[position]:.2f} is {-score:.1f} robust SDs below the pool's median "
                    f"(limit {self.config.max_z})",
                )
        return decisions


@CURATION_STAGES.register("model_judge")
def _model_judge_stage(recipe: CurateRecipe, cache_dir: str | None) -> ModelJudgeStage:
    return ModelJudgeStage(recipe.model_judge)
