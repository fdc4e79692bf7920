"""The ``reward:`` section of an RL recipe (``posttrain.rl.rewards`` scores with it).

Kept apart from the scoring code so that loading a recipe (and ``posttrain --help``, which builds every
recipe's schema) imports neither torch nor the data and eval stacks.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config.loader import StrictModel

if TYPE_CHECKING:
    from posttrain.eval.verifiers import VerifySettings

TermKind = Literal["verifier", "reward_model", "python"]
# "module:attr" (the module importable: installed, or its directory on PYTHONPATH) or "path/to/file.py:attr".
_FUNCTION = re.compile(r"([A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_][\w.]*")


class RewardSetupError(ValueError):
    """A reward cannot be built or cannot score these prompts (a function that does not import, prompts its
    verifier terms cannot check); the message names what and how to fix it. Raised at setup, never per sample."""
_ONLY_FOR: dict[str, TermKind] = {"verifier": "verifier", "path": "reward_model", "batch_size": "reward_model",
                                  "max_length": "reward_model", "dtype": "reward_model", "function": "python"}


class RewardTerm(StrictModel):
    """One term of the reward; ``name`` labels it in :attr:`RewardBatch.terms` and the metrics."""

    kind: TermKind = "verifier"
    weight: float = Field(default=1.0, description="Multiplies the term's value; negative for a penalty, 0 to log only.")
    name: str | None = Field(default=None, min_length=1, description="Default: verifier, verifier:NAME, reward_model, or the function.")
    verifier: str | None = Field(default=None, description="verifier terms: this verifier instead of each record's own.")
    path: str | None = Field(default=None, description="reward_model terms: the model directory `posttrain rm` exported.")
    batch_size: int = Field(default=16, ge=1, description="reward_model terms: sequences per forward.")
    max_length: int | None = Field(default=None, ge=8, description="reward_model terms: default, the model's training max_length.")
    dtype: Literal["float32", "bfloat16"] = "float32"
    function: str | None = Field(default=None, description='python terms: "module:attr" (importable: installed or on '
                                 'PYTHONPATH) or "path/to/file.py:attr" (relative to the working directory), called as '
                                 'fn(prompt: RLPrompt, completion: str) -> float.')

    @field_validator("weight")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number (got {value})")
        return value

    @model_validator(mode="after")
    def _check(self) -> RewardTerm:
        for key in sorted(self.changed_fields()):
            owner = _ONLY_FOR.get(key)
            if owner is not None and owner != self.kind:
                raise ValueError(f"`{key}` applies to {owner} terms only; this term is kind={self.kind}")
        if self.kind == "reward_model" and not self.path:
            raise ValueError("a reward_model term needs `path`: the directory `posttrain rm` exported (its final/ dir)")
        if self.kind == "python":
            if not self.function:
                raise ValueError('a python term needs `function: "module:attr"` or `function: "path/to/file.py:attr"` '
                                 '(fn(prompt, completion) -> float)')
            if not _FUNCTION.fullmatch(self.function):
                raise ValueError(f'`function` must read "module:attr" or "path/to/file.py:attr", e.g. '
                                 f'"mypkg.rewards:length_penalty" or "rewards.py:length_penalty" (got {self.function!r})')
        if self.verifier is not None:
            from posttrain.eval.verifiers import VERIFIERS

            if self.verifier in VERIFIERS:
                return self
            guess = difflib.get_close_matches(self.verifier, list(VERIFIERS), n=1)
            hint = f"did you mean `{guess[0]}`?" if guess else f"known: {', '.join(VERIFIERS)}"
            raise ValueError(f"unknown verifier {self.verifier!r}; {hint}")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.kind == "verifier":
            return f"verifier:{self.verifier}" if self.verifier else "verifier"
        return self.function if self.kind == "python" else "reward_model"  # type: ignore[return-value]


class CodeRewardConfig(StrictModel):
    """How ``code`` verifier items run: each in its own sandbox, ``workers`` at a time (threads here)."""

    timeout_s: float = Field(default=10.0, gt=0, description="Wall clock per run; an item's own options override.")
    cpu_s: int = Field(default=10, ge=1, description="CPU seconds per sandboxed process.")
    memory_mb: int = Field(default=1024, ge=64, description="Address space per sandboxed process.")
    workers: int = Field(default=2, ge=1, description="Code items run at once.")
    allow_unsandboxed: bool = Field(default=False, description="Run code where the sandbox cannot isolate it (a machine you can lose).")

    def verify_settings(self) -> VerifySettings:
        from posttrain.eval.sandbox import SandboxLimits
        from posttrain.eval.verifiers import VerifySettings

        limits = SandboxLimits(timeout_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb)
        return VerifySettings(code_limits=limits, allow_unsandboxed_code=self.allow_unsandboxed)


class RewardConfig(StrictModel):
    """The ``reward:`` section of an RL recipe."""

    terms: list[RewardTerm] = Field(default_factory=lambda: [RewardTerm()], min_length=1)
    timeout_s: float = Field(default=10.0, gt=0, description="Per item, for verifier and python terms in the pool.")
    workers: int = Field(
        default=2, ge=0,
        description="Pool processes for verifier and python terms; 0: in this process, no timeout or crash protection.",
    )
    code: CodeRewardConfig = Field(default_factory=CodeRewardConfig)

    @model_validator(mode="after")
    def _unique_labels(self) -> RewardConfig:
        seen: set[str] = set()
        for term in self.terms:
            if term.label in seen:
                raise ValueError(f"two terms are labelled {term.label!r}; give each its own `name`")
            seen.add(term.label)
        return self
