"""The one reward-model scorer: rewards for ``(prompt, response)`` exactly as ``posttrain rm`` trained them.

Rejection sampling (``posttrain sample`` with a reward model), RL rewards and anything else that scores
with a reward model use ``RewardScorer``. It scores a response the way the model was trained:

- the chat goes through the tokenizer's template with the response as the assistant turn
  (``tokenize_prompt_completion``, the same function that tokenised the training pairs), cut to the
  training run's ``max_length`` from its ``truncation_side`` (both read from ``posttrain_reward.json``,
  which ``posttrain rm`` writes next to the exported model; the prompt is cut, the response kept);
- the reward is the scalar head on the final hidden state of each sequence's **last token, found by
  position** — not by looking for the first pad token, which goes wrong when pad = eos.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain import dist
from posttrain.data.records import Message
from posttrain.data.tokenize import tokenize_prompt_completion

SCORER_SETTINGS = "posttrain_reward.json"
Conversation = Sequence[Message | dict[str, Any]] | str


class RewardScorer:
    """``scorer(items) -> rewards`` for ``items = [(prompt, response), ...]``; a prompt is messages or a string."""

    def __init__(self, root: torch.nn.Module, tokenizer: Any, max_length: int, truncation_side: str = "left",
                 batch_size: int = 16, device: torch.device | str = "cpu"):
        self.root, self.tokenizer = root, tokenizer
        self.max_length, self.truncation_side = max_length, truncation_side
        self.batch_size, self.device = batch_size, torch.device(device)

    @classmethod
    def from_path(cls, path: str | Path, device: str | torch.device | None = None, batch_size: int = 16,
                  max_length: int | None = None, dtype: str = "float32") -> RewardScorer:
        """Load a reward model exported by ``posttrain rm`` (any one-label HF sequence classifier works;
        without ``posttrain_reward.json`` the defaults are max_length 2048 and left truncation)."""
        from posttrain.models.load import load_tokenizer
        from posttrain.train.reward_model import RewardModel, load_reward_lm

        path = Path(path)
        settings_path = path / SCORER_SETTINGS
        settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
        tokenizer = load_tokenizer(str(path))
        device = torch.device(device) if device is not None else dist.device()
        lm = load_reward_lm(str(path), dtype, "sdpa", False, tokenizer.pad_token_id, device).eval()
        if lm.config.num_labels != 1:
            raise ValueError(f"{path}: a reward model has one label; this one has {lm.config.num_labels}")
        return cls(RewardModel(lm), tokenizer, max_length or settings.get("max_length", 2048),
                   settings.get("truncation_side", "left"), batch_size, device)

    def encode(self, prompt: Conversation, response: str) -> list[int]:
        """The token ids the reward model reads for one scored response."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return tokenize_prompt_completion(messages, [{"role": "assistant", "content": response}], self.tokenizer,
                                          self.max_length, self.truncation_side).input_ids

    @torch.no_grad()
    def __call__(self, items: Sequence[tuple[Conversation, str]]) -> list[float]:
        rewards: list[float] = []
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(items), self.batch_size):
            examples = [self.encode(prompt, response) for prompt, response in items[start : start + self.batch_size]]
            width = max(len(ids) for ids in examples)
            input_ids = torch.full((len(examples), width), pad, dtype=torch.long)
            mask = torch.zeros((len(examples), width), dtype=torch.long)
            for row, ids in enumerate(examples):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            positions = torch.arange(width).expand(len(examples), -1)
            last = torch.tensor([row * width + len(ids) - 1 for row, ids in enumerate(examples)])
            values = self.root(*(t.to(self.device) for t in (input_ids, positions, mask, last)))
            rewards.extend(float(v) for v in values.cpu())
        return rewards

    score = __call__


def load_reward_scorer(path: str | Path, device: str | torch.device | None = None, batch_size: int = 16,
                       max_length: int | None = None, dtype: str = "float32") -> RewardScorer:
    """``RewardScorer.from_path``: the scorer of a reward model exported by ``posttrain rm``."""
    return RewardScorer.from_path(path, device, batch_size, max_length, dtype)
