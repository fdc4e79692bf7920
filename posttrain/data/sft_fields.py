"""An SFT record's fields as plain data, for readers that never use the pydantic model (curation).

``sft_fields(raw, fmt)[0]`` is ``posttrain.data.formats.convert(raw, fmt, kind="sft")`` without building the
``SFTExample``: the same records are accepted, with the same messages, id, tier, difficulty and meta, and every
other record raises the same ``FormatError``, because anything out of the ordinary goes through ``convert``.

Why: reading 30 000 long records for ``posttrain curate`` spent 1.2 s in ``convert`` — pydantic validating
every ``Message`` and the ``SFTExample`` after the format checks had already made sure of everything, then the
rows copying the messages back out. Records already in the usual shape take ``_canonical`` instead: an OpenAI
``messages`` chat or a ``prompt`` + ``completion``/``response`` pair of strings, with plain ``id`` / ``tier`` /
``difficulty`` / ``kind`` / ``meta`` values. It is an accept-or-defer check: it only says yes where ``convert``
would accept and give the same fields (``tests/data/test_sft_fields.py`` holds the two side by side, bad
records included); everywhere else — a wrong type, an unknown role, an empty or NUL-holding text, a string
``meta``, content parts, another format — it returns None and ``convert`` decides, with its own error text.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from posttrain.data.formats import KNOWN_KEYS, MESSAGE_ROLES, RESPONSE_KEYS, convert
from posttrain.data.records import messages_id

_SPEAKERS = ("user", "assistant")  # roles whose text must not be blank
# Keys that make ``detect_format`` choose a format other than prompt_completion for a record with a `prompt`.
_OTHER_FORMATS = frozenset({"conversations", "chosen", "rejected", "instruction"})


class SFTFields(NamedTuple):
    """An ``SFTExample``'s fields; each message is ``{"role": …, "content": …}`` (its ``model_dump()``)."""

    messages: list[dict[str, str]]
    id: str
    tier: int | None
    difficulty: float | None
    meta: dict[str, Any]


def sft_fields(raw: Any, fmt: str = "auto", unescaped: bool = False) -> tuple[SFTFields, bool]:
    """The fields of ``convert(raw, fmt, kind="sft")``'s record, and whether its message texts are ``raw``'s own
    strings as they were decoded (the usual shape, ``_canonical``) rather than texts ``convert`` built from them
    (an Alpaca prompt joins two with a blank line). Raises ``convert``'s ``FormatError`` for a bad record.
    ``unescaped``: no string in ``raw`` needs a JSON escape (``records.messages_id``)."""
    fields = _canonical(raw, fmt, unescaped)
    if fields is not None:
        return fields, True
    record, _ = convert(raw, fmt, kind="sft")
    messages = [dict(m.__dict__) for m in record.messages]  # plain strings: the same dict as model_dump(), faster
    return SFTFields(messages, record.id, record.tier, record.difficulty, record.meta), False


def _text(value: Any, speaker: bool) -> bool:
    """``value`` is a message text ``convert`` takes as it is: a str (not a subclass: pydantic would copy it)
    without NUL; a user or assistant text also not blank."""
    return type(value) is str and "\x00" not in value and (not speaker or not value.isspace() and value != "")


def _chat(value: Any) -> list[dict[str, str]] | None:
    """An OpenAI ``messages`` list ``convert`` accepts for SFT (an assistant turn, not first), or None."""
    if type(value) is not list or not value:
        return None
    messages = []
    for item in value:
        if type(item) is not dict:
            return None
        role, content = item.get("role"), item.get("content")
        if type(role) is not str or role not in MESSAGE_ROLES or not _text(content, role in _SPEAKERS):
            return None
        messages.append({"role": role, "content": content})  # other keys of a message are ignored, as convert does
    if messages[0]["role"] == "assistant" or not any(m["role"] == "assistant" for m in messages):
        return None
    return messages


def _pair(present: dict[str, Any]) -> list[dict[str, str]] | None:
    """A prompt + completion (or response) pair of plain strings, as a user and an assistant message, or None."""
    responses = [key for key in RESPONSE_KEYS if key in present]
    if len(responses) != 1:
        return None
    prompt, response = present["prompt"], present[responses[0]]
    if not _text(prompt, True) or not _text(response, True):
        return None
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def _tags(present: dict[str, Any], fmt: str) -> tuple[str | None, int | None, float | None, dict[str, Any]] | None:
    """``(id or None, tier, difficulty, meta)`` as ``formats._tags`` makes them, or None for anything unusual."""
    meta = present.get("meta", {})
    if type(meta) is not dict or not _str_keys(meta):  # a JSON string meta: convert parses it
        return None
    meta = dict(meta)
    unknown = present.keys() - KNOWN_KEYS[fmt]
    if unknown:  # unknown keys go into meta, in key order, as convert puts them
        if not _str_keys(unknown):
            return None
        for key in sorted(unknown):
            if key in meta:
                return None
            meta[key] = present[key]
    record_id = present.get("id")
    if record_id is not None:
        if type(record_id) not in (str, int) or not str(record_id).strip():
            return None
        record_id = str(record_id)
    tier = present.get("tier")
    if type(tier) is float and tier.is_integer():
        tier = int(tier)
    if tier is not None and (type(tier) is not int or tier not in (1, 2, 3)):
        return None
    difficulty = present.get("difficulty")
    if difficulty is not None:
        if type(difficulty) not in (int, float) or not math.isfinite(difficulty):
            return None
        difficulty = float(difficulty)
    if present.get("kind", "sft") != "sft":
        return None
    return record_id, tier, difficulty, meta


def _str_keys(keys: Any) -> bool:
    """Every key is a str (pydantic refuses others in ``meta``; JSON has no others)."""
    for key in keys:
        if type(key) is not str:
            return False
    return True


def _canonical(raw: Any, fmt: str, unescaped: bool = False) -> SFTFields | None:
    """The fields of a record in the usual shape (see the module docstring), or None: then ``convert`` decides.
    Keys that are not strings end up among the unknown keys, whose type ``_tags`` checks."""
    if type(raw) is not dict:
        return None
    present = {key: value for key, value in raw.items() if value is not None}  # a null counts as absent
    if "messages" in present:
        found, messages = "messages", _chat(present["messages"])
    elif "prompt" in present and present.keys().isdisjoint(_OTHER_FORMATS):
        found, messages = "prompt_completion", _pair(present)
    else:
        return None
    if messages is None or fmt not in ("auto", found):
        return None
    tags = _tags(present, found)
    if tags is None:
        return None
    record_id, tier, difficulty, meta = tags
    if record_id is None:
        try:
            record_id = messages_id(messages, "sft-", unescaped)
        except UnicodeEncodeError:  # a lone surrogate: convert reports it
            return None
    return SFTFields(messages, record_id, tier, difficulty, meta)
