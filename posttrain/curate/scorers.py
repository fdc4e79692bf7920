"""Candidate scorers for rejection sampling: verifier, reward model, or judge.

A scorer takes prompts and, for each prompt, its candidate responses, and returns one score per
candidate (``None`` when it cannot score one). Scores are compared only between candidates of the
same prompt, so scorers need not share a scale:

- ``VerifierScorer``: the prompt's own verifier (``posttrain.eval.verifiers``), score in [0, 1];
  for prompts with an answer key (``answer``, ``tests`` or verifier options).
- ``RewardModelScorer``: an HF ``AutoModelForSequenceClassification`` with one label (a reward
  model as ``posttrain rm`` trains it); the score is the head's logit at the last non-padding
  token of ``chat_template(prompt + [assistant: candidate])``, the full chat rendered as in training.
- ``JudgeScorer``: the curation judge's 1-5 quality score (rule-based or LLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

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
    """Scores ``(prompt, response)`` with a one-label sequence classifier, in batches."""

    name = "reward_model"

    def __init__(self, config: RewardModelConfig, model: Any = None, tokenizer: Any = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from posttrain.models.load import DTYPES

        self.config = config
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The reward is read at the last token, so an over-long text loses its start, never its end
        # (as ``posttrain rm`` truncates when it trains).
        self.tokenizer.truncation_side = "left"
        self.model = model or AutoModelForSequenceClassification.from_pretrained(
            config.path, dtype=DTYPES[config.dtype]
        )
        if self.model.config.num_labels != 1:
            raise ValueError(f"{config.path}: a reward model has one label; this one has {self.model.config.num_labels}")
        if self.model.config.pad_token_id is None:  # HF pools the last non-padding token via pad_token_id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval()
        if torch.cuda.is_available() and model is None:
            self.model.to("cuda")

    def render(self, messages: list[dict[str, str]], response: str) -> str:
        chat = [*messages, {"role": "assistant", "content": response}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(chat, tokenize=False)
        return "\n".join(m["content"] for m in chat)

    def score_texts(self, texts: list[str]) -> list[float]:
        device = next(self.model.parameters()).device
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.config.batch_size):
                batch = texts[start : start + self.config.batch_size]
                encoded = self.tokenizer(batch, padding=True, truncation=True, max_length=self.config.max_length,
                                         add_special_tokens=False, return_tensors="pt")  # fmt: skip
                logits = self.model(**{k: v.to(device) for k, v in encoded.items()}).logits
                scores.extend(logits[:, 0].float().cpu().tolist())
        return scores

    def score(self, prompts: list[PromptRecord], candidates: list[list[str]]) -> list[list[float | None]]:
        texts = [self.render(p.messages, text) for p, texts in zip(prompts, candidates, strict=True) for text in texts]
        flat = self.score_texts(texts)
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
