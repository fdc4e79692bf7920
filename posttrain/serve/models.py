"""Request bodies of the feedback API (unknown keys are rejected) and the service's size and rate limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from posttrain.config.loader import StrictModel
from posttrain.data.records import Message
from posttrain.serve.text import is_blank, json_chars, json_problem

REASON_REQUIRED = "a reason is required: say in a sentence why this answer is better (or why both are bad / equal)"


@dataclass(frozen=True)
class Limits:
    """What one request may carry, and how fast one token may call. ``rate <= 0`` turns rate limiting off."""

    max_body_bytes: int = 1 << 20  # one JSON request
    max_bulk_bytes: int = 16 << 20  # one JSONL bulk import request
    max_text_chars: int = 100_000  # one prompt, response text, signal detail text or reason
    max_json_chars: int = 32_768  # one JSON object (sampling settings, signal detail object, metadata), as stored
    rate: float = 20.0  # requests per second per user (API token or page session), sustained
    burst: int = 60  # requests a user may make at once


def _visible(text: str) -> str:
    if is_blank(text):
        raise ValueError("must contain visible text, not only whitespace or invisible characters")
    return text


VisibleText = Annotated[str, AfterValidator(_visible)]


class _Body(StrictModel):
    """A request body: refused (422) when nested too deep or when a string cannot be stored (``text.py``)."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        problem = json_problem(data)
        if problem:
            raise ValueError(problem)
        return data


class Response(StrictModel):
    text: VisibleText = Field(min_length=1)
    model_id: VisibleText = Field(min_length=1, max_length=200)
    sampling: dict[str, Any] = Field(default_factory=dict)


class Signal(StrictModel):
    type: str = Field(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_]*$",
                      description="thumbs_down, failed_verifier, …")
    detail: str | dict[str, Any] | None = None


class EdgeCaseIn(_Body):
    prompt: str | list[Message]
    responses: list[Response] = Field(min_length=1, max_length=32)
    signal: Signal
    source: VisibleText = Field(min_length=1, max_length=200)
    group: str | None = Field(default=None, max_length=200)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def stored(self) -> dict[str, Any]:
        """The case as the store takes it (chat prompts as plain dicts)."""
        return self.model_dump(mode="json")


class ResponsesIn(_Body):
    responses: list[Response] = Field(min_length=1, max_length=32)


class VoteIn(_Body):
    task_id: str = Field(min_length=1, max_length=100)
    choice: Literal["left", "right", "tie", "both_bad"]
    reason: str = ""  # checked by ``record_vote`` (shared with the page), which answers REASON_REQUIRED


# The most tasks one ``GET /api/tasks`` hands out and votes one ``POST /api/votes/bulk`` carries: enough to
# take a scripted annotator's per-request cost out of the loop, few enough that a batch stays well under
# ``Limits.max_body_bytes`` with ordinary reasons.
MAX_BATCH = 100


class VotesIn(_Body):
    votes: list[VoteIn] = Field(min_length=1, max_length=MAX_BATCH)


def prompt_chars(prompt: str | list[dict]) -> int:
    return len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)


def oversized_text(data: dict[str, Any], limits: Limits) -> str | None:
    """Why ``data`` (an edge case or a responses body) breaks a size limit, or None.

    Every field the store keeps is bounded: texts by ``max_text_chars``, JSON objects by ``max_json_chars``
    of their stored form; names and ids have ``max_length`` in the models above.
    """
    texts, blobs = limits.max_text_chars, limits.max_json_chars
    if "prompt" in data and prompt_chars(data["prompt"]) > texts:
        return f"prompt has {prompt_chars(data['prompt'])} characters; the limit is {texts} per text"
    for index, response in enumerate(data.get("responses", [])):
        if len(response["text"]) > texts:
            return f"responses[{index}].text has {len(response['text'])} characters; the limit is {texts} per text"
        if json_chars(response.get("sampling") or {}) > blobs:
            return (f"responses[{index}].sampling is {json_chars(response['sampling'])} characters as JSON; "
                    f"the limit is {blobs}")  # fmt: skip
    detail = (data.get("signal") or {}).get("detail")
    if isinstance(detail, str) and len(detail) > texts:
        return f"signal.detail has {len(detail)} characters; the limit is {texts} per text"
    if isinstance(detail, dict) and json_chars(detail) > blobs:
        return f"signal.detail is {json_chars(detail)} characters as JSON; the limit is {blobs}"
    if "metadata" in data and json_chars(data["metadata"]) > blobs:
        return f"metadata is {json_chars(data['metadata'])} characters as JSON; the limit is {blobs}"
    return None
