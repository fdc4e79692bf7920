"""Candidate scorers for rejection sampling: verifier, reward model, or judge.

A scorer takes prompts and, for each prompt, its candidate responses, and returns one score per
candidate (``None`` when it cannot score one). Scores are compared only between candidates of the
same prompt, so scorers need not share a scale:

- ``VerifierScorer``: the prompt's own verifier (``posttrain.eval.verifiers``), score in [0, 1];
  for prompts with an answer key (``answer``, ``tests`` or verifier options).
- ``RewardModelScorer``: a reward model as ``posttrain rm`` trains it, through the one scorer
  (``posttrain.train.reward_scorer``): the chat tokenised and truncated as in training, the head's
  value at the last token.
- ``JudgeScorer``: the curation judge's 1-5 quality score (rule-based or LLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from posttrain.curate.config import JudgeConfig, RewardModelConfig


@dataclass
class PromptRecord:
    id: str
    messages: list[dict[str, str]]  # the prompt as a chat (no assistant reply at the end)
    verifier: str | None = None
    answer: str | None = None
    tests: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    tier: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    line: int = 0

    @property
    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)

    @property
    def verifiable(self) -> bool:
        return bool(self.verifier) and (self.answer is not None or self.tests is not None or bool(self.options))


class Scorer(Protocol):
    name: str

    def score(self, prompts: list[PromptRecord], candidates: list[list[str]]) -> list[list[float | None]]: ...


class VerifierScorer:
    name = "verifier"

    def score(self, prompts: list[PromptRecord], candidates: list[list[str]]) -> list[list[float | None]]:
        from posttrain.eval.items import EvalItem
        from posttrain.eval.verifiers import verify

        out: list[list[float | None]] = []
        for prompt, texts in zip(prompts, candidates, strict=True):
            item = EvalItem(id=prompt.id, prompt=prompt.text, verifier=prompt.verifier, answer=prompt.answer,
                            tests=prompt.tests, options=prompt.options)  # fmt: skip
            out.append([float(verify(item, text).score) for text in texts])
        return out


class RewardModelScorer:
    """Scores each candidate with ``posttrain.train.reward_scorer.RewardScorer``: the prompt chat plus the
    candidate as the assistant turn, tokenised and truncated as ``posttrain rm`` trained the model, the
    reward read at the last token by position."""

    name = "reward_model"

    def __init__(self, config: RewardModelConfig):
        from posttrain.train.reward_scorer import RewardScorer

        self.config = config
        self.scorer = RewardScorer.from_path(config.path, batch_size=config.batch_size, max_length=config.max_length,
                                             dtype=config.dtype)

    def score(self, prompts: list[PromptRecord], candidates: list[list[str]]) -> list[list[float | None]]:
        items = [(p.messages, text) for p, texts in zip(prompts, candidates, strict=True) for text in texts]
        flat = self.scorer(items)
        out, position = [], 0
        for texts in candidates:
            out.append(flat[position : position + len(texts)])
            position += len(texts)
        return out


class JudgeScorer:
    name = "judge"

    def __init__(self, config: JudgeConfig):
        from posttrain.curate.judge import LLMJudge, RuleJudge

        self.judge = LLMJudge(config) if config.kind == "llm" else RuleJudge()

    def score(self, prompts: list[PromptRecord], candidates: list[list[str]]) -> list[list[float | None]]:
        from posttrain.curate.rows import Row

        rows = [
            Row(index=0, source="", line=0, id=p.id, messages=[*p.messages, {"role": "assistant", "content": text}])
            for p, texts in zip(prompts, candidates, strict=True)
            for text in texts
        ]
        flat = [None if j.score is None else float(j.score) for j in self.judge.judge(rows)]
        out, position = [], 0
        for texts in candidates:
            out.append(flat[position : position + len(texts)])
            position += len(texts)
        return out
