"""The three record kinds every stage reads and writes, each with a stable id.

- ``SFTExample``: a chat (``messages``) whose assistant turns are the training targets.
- ``PreferencePair``: a ``prompt`` conversation, a ``chosen`` and a ``rejected`` assistant reply, the
  annotator's ``rationale`` (kept verbatim through the pipeline) and optional scores.
- ``RLPrompt``: a ``prompt`` conversation plus what a verifier needs (``answer``, ``tests``).

All three may carry ``tier`` (1 basic comprehension, 2 logical application, 3 complex creation), a
numeric ``difficulty`` and free-form ``meta``. Conversions from external formats (ShareGPT, Alpaca,
TRL preference data, …) live in ``posttrain.data.formats``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from posttrain.data.json_text import ROLES_UTF8, TextEncoder, encode_string, string_body_utf8

Role = Literal["system", "user", "assistant", "tool"]


_ID_JSON = TextEncoder(sort_keys=True, separators=(",", ":"))  # compact, keys sorted, non-ASCII text as it is


def stable_id(payload: Any, prefix: str = "") -> str:
    """A content hash: the same record always gets the same id, on every machine."""
    text = _ID_JSON.encode(payload)
    return prefix + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def messages_id(messages: list[dict[str, str]], prefix: str = "", unescaped: bool = False) -> str:
    """``stable_id(messages, prefix)`` of ``{"role", "content"}`` dicts, twice as fast: the same compact JSON with
    sorted keys (content, then role), framed here instead of by the generic encoder and fed to the hash piece by
    piece, each text's UTF-8 bytes as they are when it needs no escape (no copy of the whole chat is made).
    ``unescaped``: the caller knows that no text needs one (``string_body_utf8``'s check, a third of the time here,
    is skipped) — true of every string decoded from JSON text without a backslash (see ``rows.parse_line``)."""
    body = str.encode if unescaped else string_body_utf8  # str.encode: UTF-8, raising for a lone surrogate
    digest = hashlib.sha256()
    opening = b'[{"content":"'
    try:
        for message in messages:
            digest.update(opening)
            digest.update(body(message["content"]))
            digest.update(b'","role":"')
            role = message["role"]
            digest.update(ROLES_UTF8.get(role) or body(role))
            digest.update(b'"}')
            opening = b',{"content":"'
    except UnicodeEncodeError:  # a lone surrogate: raised as stable_id raises it, at the same position
        parts = [f'{{"content":{encode_string(m["content"])},"role":{encode_string(m["role"])}}}' for m in messages]
        f"[{','.join(parts)}]".encode()
        raise
    digest.update(b"]" if messages else b"[]")
    return prefix + digest.hexdigest()[:16]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Message(_Record):
    role: Role
    content: str

    @field_validator("content")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("contains a NUL character")
        return value


def _plain(messages: list[Message]) -> list[dict[str, str]]:
    """Each message's ``model_dump()``: its two string fields, without pydantic's serializer (5x faster)."""
    return [{"role": m.role, "content": m.content} for m in messages]


def _check_conversation(messages: list[Message], name: str, need_assistant: bool) -> None:
    if not messages:
        raise ValueError(f"{name} is empty")
    for index, message in enumerate(messages):
        if message.role in ("user", "assistant") and not message.content.strip():
            raise ValueError(f"{name}[{index}] ({message.role}) has empty content")
    if need_assistant and not any(m.role == "assistant" for m in messages):
        raise ValueError(f"{name} has no assistant message to learn from")


ASSISTANT_FIRST = (
    "the conversation starts with an assistant turn: there is no prompt before it for the model to answer "
    "(and no chat template can render where its text starts); put the user message it answers before it, "
    "or drop it"
)


def starts_with_assistant(messages: list[Message]) -> bool:
    """An SFT chat whose first message is the assistant's: a target with nothing before it to condition on."""
    return bool(messages) and messages[0].role == "assistant"


class _Tagged(_Record):
    id: str = ""
    tier: int | None = Field(default=None, ge=1, le=3)
    difficulty: float | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class SFTExample(_Tagged):
    kind: Literal["sft"] = "sft"
    messages: list[Message]

    @model_validator(mode="after")
    def _check(self) -> SFTExample:
        _check_conversation(self.messages, "messages", need_assistant=True)
        if starts_with_assistant(self.messages):
            raise ValueError(ASSISTANT_FIRST)
        if not self.id:
            self.id = messages_id(_plain(self.messages), "sft-")
        return self


class PreferencePair(_Tagged):
    kind: Literal["preference"] = "preference"
    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    rationale: str | None = None
    chosen_score: float | None = None
    rejected_score: float | None = None

    @model_validator(mode="after")
    def _check(self) -> PreferencePair:
        _check_conversation(self.prompt, "prompt", need_assistant=False)
        _check_conversation(self.chosen, "chosen", need_assistant=True)
        _check_conversation(self.rejected, "rejected", need_assistant=True)
        if _plain(self.chosen) == _plain(self.rejected):
            raise ValueError("chosen and rejected are identical: the pair carries no preference")
        if not self.id:
            payload = [_plain(part) for part in (self.prompt, self.chosen, self.rejected)]
            self.id = stable_id(payload, "pref-")
        return self


class RLPrompt(_Tagged):
    kind: Literal["rl"] = "rl"
    prompt: list[Message]
    answer: str | None = None
    verifier: str | None = None
    tests: str | None = None
    group: str | None = None

    @model_validator(mode="after")
    def _check(self) -> RLPrompt:
        _check_conversation(self.prompt, "prompt", need_assistant=False)
        if not self.id:
            self.id = messages_id(_plain(self.prompt), "rl-")
        return self


Record = SFTExample | PreferencePair | RLPrompt
RECORD_KINDS: dict[str, type[_Tagged]] = {"sft": SFTExample, "preference": PreferencePair, "rl": RLPrompt}


def user(text: str) -> Message:
    return Message(role="user", content=text)


def assistant(text: str) -> Message:
    return Message(role="assistant", content=text)
