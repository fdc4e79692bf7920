"""Stage 8, difficulty tiers: 1 basic comprehension, 2 logical application, 3 complex creation.

Each available signal maps a record to a difficulty in [0, 1]; the record's ``difficulty`` is the
weighted mean of its available signals and its tier comes from two thresholds. Signals:

- ``judge``: the judge's complexity rating c ∈ {1, 2, 3} → (c − 1) / 2.
- ``ifd``: Instruction-Following Difficulty (Li et al. 2024, "From Quantity to Quality: Boosting LLM
  Performance with Self-Guided Data Selection for Instruction Tuning", the Cherry LLM paper):
  ``IFD(Q, A) = L(A | Q) / L(A)``, the mean token loss of the answer given the question over the mean
  loss of the answer alone, under a reference model. Near 1 the question barely helps predict the
  answer (hard to follow); mapped to difficulty as ``clip(IFD, 0, 1)``. IFD > 1 marks a misaligned
  pair, which the paper filters out (``ifd.drop_above: 1.0``).
- ``features``: the mean of three surface features, each in [0, 1]: reasoning steps in the response
  (numbered or bulleted lines, connectives; 6 or more = 1), constraints in the prompt (``must``,
  ``exactly``, ``at least``, formats …; 4 or more = 1) and response length on a log scale (10 words or
  fewer = 0, ``long_response_words`` = 1; ``length_signal``).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

import torch

from posttrain.curate.config import CurateRecipe, DifficultyConfig, IFDConfig
from posttrain.curate.registry import CURATION_STAGES
from posttrain.curate.rows import Drop, Row

_STEP_LINE = re.compile(r"^\s*(?:\d+[.)]|[-*•]|step \d+)", re.I | re.M)
_CONNECTIVE = re.compile(r"\b(first|second|then|next|finally|therefore|because|so that|thus|hence)\b", re.I)
_CONSTRAINT = re.compile(
    r"\b(must|should|exactly|at least|at most|no more than|without|only|do not|don't|never|always|"
    r"format|json|bullet|uppercase|lowercase|begin with|end with|include|exclude|in \d+ (?:words|sentences))\b",
    re.I,
)


def reasoning_steps(response: str) -> int:
    return len(_STEP_LINE.findall(response)) + len(_CONNECTIVE.findall(response))


def constraint_count(prompt: str) -> int:
    return len(_CONSTRAINT.findall(prompt))


def length_signal(n_words: int, long_response_words: int, short_response_words: int = 10) -> float:
    """Response length on a log scale: 0 at ``short_response_words`` or fewer, 1 at ``long_response_words``.

    Log, not linear: on real answers (calibration set: docstrings, reference paragraphs, package
    descriptions of 12-250 words) a linear scale to 300 words put nearly every answer near 0, so every
    record landed in tier 1; doubling an answer's length adds the same difficulty at any length.
    """
    if n_words <= short_response_words:
        return 0.0
    return min(math.log(n_words / short_response_words) / math.log(long_response_words / short_response_words), 1.0)


def feature_difficulty(prompt: str, response: str, long_response_words: int) -> float:
    steps = min(reasoning_steps(response) / 6, 1.0)
    constraints = min(constraint_count(prompt) / 4, 1.0)
    length = length_signal(len(response.split()), long_response_words)
    return (steps + constraints + length) / 3


def combine_signals(signals: dict[str, float], weights: dict[str, float]) -> float | None:
    """Weighted mean of the signals that are present (``None`` when none is)."""
    used = {name: value for name, value in signals.items() if weights.get(name, 0) > 0}
    total = sum(weights[name] for name in used)
    return sum(weights[name] * value for name, value in used.items()) / total if total else None


def tier_of(difficulty: float, thresholds: tuple[float, float]) -> int:
    low, high = thresholds
    return 1 if difficulty < low else 2 if difficulty < high else 3


def ifd_ratio(conditioned_loss: float, unconditioned_loss: float) -> float:
    """IFD = L(A|Q) / L(A) (Li et al. 2024)."""
    return conditioned_loss / max(unconditioned_loss, 1e-8)


# -- IFD under a reference model --------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _reference_model(path: str, dtype: str):
    from posttrain.models.load import load_model, load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(path, dtype=dtype, device=device)
    model.eval()
    return model, load_tokenizer(path)


def _answer_nll(model, rows: list[tuple[list[int], list[int]]], pad_id: int) -> list[float]:
    """Mean negative log-likelihood of the answer tokens of each ``(context_ids, answer_ids)``."""
    from posttrain.data.packing import collate_padded
    from posttrain.data.tokenize import TokenizedExample
    from posttrain.models.logprobs import IGNORE_INDEX, mean_label_logprobs

    examples = [TokenizedExample(context + answer, [IGNORE_INDEX] * len(context) + answer, False, "")
                for context, answer in rows]
    batch = collate_padded(examples, pad_id)
    means = mean_label_logprobs(model, batch["input_ids"], batch["labels"], batch["attention_mask"])
    return [-m if m == m else 0.0 for m in means]  # an answer without tokens scored 0, as before


def ifd_scores(
    prompts: Sequence[list[dict[str, str]]], responses: Sequence[str], config: IFDConfig
) -> list[float | None]:
    """IFD per record; ``None`` for a record whose answer has no tokens."""
    model, tokenizer = _reference_model(config.model, config.dtype)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    conditioned, unconditioned, valid = [], [], []
    for messages, response in zip(prompts, responses, strict=True):
        answer = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + eos
        context = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        context_ids = list(tokenizer(context, add_special_tokens=False)["input_ids"])
        budget = config.max_length
        answer = answer[: max(budget // 2, budget - len(context_ids))]
        context_ids = context_ids[-(budget - len(answer)) :] if budget > len(answer) else []
        valid.append(bool(answer))
        conditioned.append((context_ids, answer))
        unconditioned.append((bos, answer))
    out: list[float | None] = [None] * len(responses)
    for start in range(0, len(responses), config.batch_size):
        chosen = [i for i in range(start, min(start + config.batch_size, len(responses))) if valid[i]]
        if not chosen:
            continue
        cond = _answer_nll(model, [conditioned[i] for i in chosen], pad)
        uncond = _answer_nll(model, [unconditioned[i] for i in chosen], pad)
        for i, c, u in zip(chosen, cond, uncond, strict=True):
            out[i] = round(ifd_ratio(c, u), 6)
    return out


class DifficultyStage:
    name = "difficulty"

    def __init__(self, config: DifficultyConfig):
        self.config = config

    def apply(self, rows: list[Row]) -> list[Drop | None]:
        weights = dict(self.config.weights)
        ifd: list[float | None] = [None] * len(rows)
        if self.config.ifd is not None and weights.get("ifd", 0) > 0 and rows:
            contexts = [row.context() for row in rows]
            ifd = ifd_scores(contexts, [row.response for row in rows], self.config.ifd)
        results: list[Drop | None] = []
        for row, ifd_value in zip(rows, ifd, strict=True):
            signals: dict[str, float] = {}
            if row.scores.get("judge_complexity") is not None:
                signals["judge"] = (row.scores["judge_complexity"] - 1) / 2
            if ifd_value is not None:
                row.scores["ifd"] = ifd_value
                signals["ifd"] = min(max(ifd_value, 0.0), 1.0)
            signals["features"] = feature_difficulty(row.prompt, row.response, self.config.long_response_words)
            difficulty = combine_signals(signals, weights)
            if difficulty is None:  # only unavailable signals have weight: fall back to features
                difficulty = signals["features"]
            row.difficulty = round(difficulty, 4)
            if row.tier is None or not self.config.keep_given_tier:
                row.tier = tier_of(difficulty, self.config.tier_thresholds)
            row.scores["difficulty_signals"] = {name: round(value, 4) for name, value in signals.items()}
            limit = self.config.ifd.drop_above if self.config.ifd else None
            drop = limit is not None and ifd_value is not None and ifd_value > limit
            results.append(Drop("ifd_too_high", f"IFD {ifd_value:.3f} > {limit}") if drop else None)
        return results


@CURATION_STAGES.register("difficulty")
def _difficulty_stage(recipe: CurateRecipe, cache_dir: str | None) -> DifficultyStage:
    return DifficultyStage(recipe.difficulty)
