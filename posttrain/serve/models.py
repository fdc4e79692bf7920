"""Request bodies of the feedback API (unknown keys are rejected) and the service's size and rate limits."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from posttrain.config.loader import StrictModel
from posttrain.data.records import Message

REASON_REQUIRED = "a reason is required: say in a sentence why this answer is better (or why both are bad / equal)"


@dataclass(frozen=True)
class Limits:
    """What one request may carry, and how fast one token may call. ``rate <= 0`` turns rate limiting off."""

    max_body_bytes: int = 1 << 20  # one JSON request
    max_bulk_bytes: int = 16 << 20  # one JSONL bulk import request
    max_text_chars: int = 100_000  # one prompt or response text
    rate: float = 20.0  # requests per second per token, sustained
    burst: int = 60  # requests a token may make at once


class Response(StrictModel):
    text: str = Field(min_length=1)
    model_id: str = Field(min_length=1, max_length=200)
    sampling: dict[str, Any] = Field(default_factory=dict)


class Signal(StrictModel):
    type: str = Field(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_]*$",
                      description="thumbs_down, failed_verifier, …")
    detail: str | dict[str, Any] | None = None


class EdgeCaseIn(StrictModel):
    prompt: str | list[Message]
    responses: list[Response] = Field(min_length=1, max_length=32)
    signal: Signal
    source: str = Field(min_length=1, max_length=200)
    group: str | None = Field(default=None, max_length=200)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def stored(self) -> dict[str, Any]:
        """The case as the store takes it (chat prompts as plain dicts)."""
        return self.model_dump(mode="json")


class ResponsesIn(StrictModel):
    responses: list[Response] = Field(min_length=1, max_length=32)


class VoteIn(StrictModel):
    task_id: str = Field(min_length=1, max_length=100)
    choice: Literal["left", "right", "tie", "both_bad"]
    reason: str = ""


def prompt_chars(prompt: str | list[dict]) -> int:
    return len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)


def oversized_text(data: dict[str, Any], limit: int) -> str | None:
    """Why ``data`` (an edge case or a responses body) breaks the per-text limit, or None."""
    if "prompt" in data and prompt_chars(data["prompt"]) > limit:
        return f"prompt has {prompt_chars(data['prompt'])} characters; the limit is {limit} per text"
    for index, response in enumerate(data.get("responses", [])):
        if len(response["text"]) > limit:
            return f"responses[{index}].text has {len(response['text'])} characters; the limit is {limit} per text"
    if "metadata" in data and len(json.dumps(data["metadata"])) > limit:
        return f"metadata is {len(json.dumps(data['metadata']))} characters as JSON; the limit is {limit}"
    return None
