"""External data formats → posttrain records, with detection and errors that name the bad field.

Supported formats (``FORMATS``), and the keys that identify each one in ``detect_format``:

==============================  ============================================  ======================
format                          shape of one record                           becomes
==============================  ============================================  ======================
``messages`` (OpenAI)           ``{"messages": [{"role", "content"}, ...]}``  ``SFTExample``
``sharegpt``                    ``{"conversations": [{"from", "value"}]}``    ``SFTExample``
``alpaca``                      ``{"instruction", "input"?, "output"}``       ``SFTExample``
``preference`` (TRL standard)   ``{"prompt": str, "chosen": str,              ``PreferencePair``
                                "rejected": str}``
``preference_conversational``   ``{"prompt"?: [msgs], "chosen": [msgs],       ``PreferencePair``
(TRL conversational)            "rejected": [msgs]}``
``rl``                          ``{"prompt": str | [msgs], "answer"?, ...}``  ``RLPrompt``
==============================  ============================================  ======================

Every format may also carry ``id`` (string or integer), ``tier`` (1–3), ``difficulty`` (number),
``meta`` (an object, or a JSON-object string as Parquet stores it) and ``kind`` (``sft`` /
``preference`` / ``rl``, written by ``write_records``; checked against the format). Preference
records may carry ``rationale`` (the annotator's reason) and ``chosen_score`` / ``rejected_score``
(``score_chosen`` / ``score_rejected`` as in UltraFeedback are accepted too). Keys a format does not
know are kept, not dropped: they go into ``meta`` under their own name. A key whose value is
``null`` counts as absent (Parquet fills missing columns with nulls).

A conversational preference record without ``prompt`` (TRL's *implicit prompt*) is split at the
first message where ``chosen`` and ``rejected`` differ; the shared messages become the prompt.

Conversion errors are ``FormatError``: they carry the field path in the input's own terms
(``conversations[2].value``), a human reason, and a short ``category`` used to count bad records.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError

from posttrain.data.records import Message, PreferencePair, Record, RLPrompt, SFTExample

FORMATS: tuple[str, ...] = (
    "messages",
    "sharegpt",
    "alpaca",
    "preference",
    "preference_conversational",
    "rl",
)

FORMAT_KIND = {
    "messages": "sft",
    "sharegpt": "sft",
    "alpaca": "sft",
    "preference": "preference",
    "preference_conversational": "preference",
    "rl": "rl",
}

# Categories used to count bad records by reason (``ReadReport.reasons``).
MALFORMED_JSON = "malformed JSON"
INVALID_UTF8 = "invalid UTF-8"
NOT_AN_OBJECT = "not a JSON object"
UNKNOWN_FORMAT = "unknown format"
MISSING_FIELD = "missing field"
WRONG_TYPE = "wrong type"
INVALID_VALUE = "invalid value"
EMPTY_MESSAGE = "empty message"
EMPTY_PROMPT = "empty prompt"
IDENTICAL_PAIR = "identical chosen/rejected"
NO_ASSISTANT = "no assistant turn"
WRONG_KIND = "wrong record kind"

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function_response": "tool",
    "observation": "tool",
}
MESSAGE_ROLES = ("system", "user", "assistant", "tool")

_COMMON_KEYS = {"id", "tier", "difficulty", "meta", "kind"}
_FORMAT_KEYS = {
    "messages": {"messages"},
    "sharegpt": {"conversations"},
    "alpaca": {"instruction", "input", "output", "system"},
    "preference": {"prompt", "chosen", "rejected", "rationale", "chosen_score", "rejected_score",
                   "score_chosen", "score_rejected"},
    "rl": {"prompt", "answer", "verifier", "tests", "group"},
}
_FORMAT_KEYS["preference_conversational"] = _FORMAT_KEYS["preference"]


class FormatError(ValueError):
    """A record does not fit its format. ``field`` is a path in the input's terms, or None."""

    def __init__(self, field: str | None, reason: str, category: str):
        self.field, self.reason, self.category = field, reason, category
        super().__init__(f"`{field}`: {reason}" if field else reason)


def _present(raw: dict) -> dict:
    """The record without null-valued keys: a null means "absent" (Parquet nulls, optional columns)."""
    return {key: value for key, value in raw.items() if value is not None}


def detect_format(raw: dict) -> str:
    """Name the format of one raw record from its keys; raise ``ValueError`` naming the keys seen."""
    if not isinstance(raw, dict):
        raise FormatError(None, f"expected a JSON object, got {type(raw).__name__}", NOT_AN_OBJECT)
    keys = _present(raw)
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if "chosen" in keys or "rejected" in keys:
        sample = keys.get("chosen", keys.get("rejected"))
        return "preference_conversational" if isinstance(sample, list) else "preference"
    if "instruction" in keys and "output" in keys:
        return "alpaca"
    if "prompt" in keys and "completion" in keys:
        raise FormatError(
            "completion",
            "prompt/completion records (TRL's prompt-completion SFT format) are not supported; "
            "convert them to {\"messages\": [user, assistant]}",
            UNKNOWN_FORMAT,
        )
    if "prompt" in keys:
        return "rl"
    seen = ", ".join(sorted(keys)) or "none"
    raise FormatError(
        None,
        f"cannot tell the format from the keys ({seen}); expected `messages` (OpenAI), `conversations` "
        "(ShareGPT), `instruction`+`output` (Alpaca), `prompt`+`chosen`+`rejected` (preference) or "
        "`prompt` (RL)",
        UNKNOWN_FORMAT,
    )


# ---------------------------------------------------------------------------------------- field checks


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _require(raw: dict, key: str) -> Any:
    if key not in raw:
        raise FormatError(key, "required field is missing", MISSING_FIELD)
    return raw[key]


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise FormatError(field, f"expected a string, got {_type_name(value)}", WRONG_TYPE)
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FormatError(field, f"expected a number, got {_type_name(value)}", WRONG_TYPE)
    if not math.isfinite(value):
        raise FormatError(field, f"expected a finite number, got {value}", INVALID_VALUE)
    return float(value)


def _nonempty(text: str, field: str, category: str = EMPTY_MESSAGE) -> str:
    if not text.strip():
        raise FormatError(field, "is empty", category)
    if "\x00" in text:
        raise FormatError(field, "contains a NUL character", INVALID_VALUE)
    return text


def _content(value: Any, field: str) -> str:
    """Message content: a string, or OpenAI content parts of type ``text`` (joined without separator)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            path = f"{field}[{index}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise FormatError(path, f"only text content parts are supported, got {kind!r}", WRONG_TYPE)
            texts.append(_string(part.get("text"), f"{path}.text"))
        return "".join(texts)
    raise FormatError(field, f"expected a string, got {_type_name(value)}", WRONG_TYPE)


def _messages(value: Any, field: str, role_key: str = "role", text_key: str = "content",
              role_map: dict[str, str] | None = None) -> list[Message]:
    """Validate a list of chat messages; errors name ``field[i].key``. Empty user/assistant text is an error."""
    if not isinstance(value, list):
        raise FormatError(field, f"expected a list of messages, got {_type_name(value)}", WRONG_TYPE)
    if not value:
        raise FormatError(field, "has no messages", EMPTY_MESSAGE)
    out = []
    for index, item in enumerate(value):
        path = f"{field}[{index}]"
        if not isinstance(item, dict):
            raise FormatError(path, f"expected a message object, got {_type_name(item)}", WRONG_TYPE)
        if role_key not in item:
            raise FormatError(f"{path}.{role_key}", "required field is missing", MISSING_FIELD)
        raw_role = _string(item[role_key], f"{path}.{role_key}")
        role = role_map.get(raw_role.lower()) if role_map is not None else raw_role
        if role not in MESSAGE_ROLES:
            allowed = sorted(role_map) if role_map is not None else list(MESSAGE_ROLES)
            raise FormatError(f"{path}.{role_key}", f"unknown role {raw_role!r}; expected one of {allowed}",
                              INVALID_VALUE)
        if text_key not in item or item[text_key] is None:
            raise FormatError(f"{path}.{text_key}", "required field is missing", MISSING_FIELD)
        text = _content(item[text_key], f"{path}.{text_key}")
        if role in ("user", "assistant"):
            _nonempty(text, f"{path}.{text_key}")
        elif "\x00" in text:
            raise FormatError(f"{path}.{text_key}", "contains a NUL character", INVALID_VALUE)
        out.append(Message(role=role, content=text))
    return out


def _prompt(value: Any, field: str = "prompt") -> list[Message]:
    """A prompt given as plain text (one user message) or as a list of messages."""
    if isinstance(value, str):
        return [Message(role="user", content=_nonempty(value, field, EMPTY_PROMPT))]
    if isinstance(value, list) and not value:
        raise FormatError(field, "is empty", EMPTY_PROMPT)
    return _messages(value, field)


def _need_assistant(messages: list[Message], field: str) -> None:
    if not any(m.role == "assistant" for m in messages):
        raise FormatError(field, "has no assistant message to learn from", NO_ASSISTANT)


# ------------------------------------------------------------------------------------ common fields


def _meta(raw: dict, fmt: str) -> dict[str, Any]:
    meta = raw.get("meta", {})
    if isinstance(meta, str):
        try:
            meta = json.loads(meta) if meta.strip() else {}
        except json.JSONDecodeError as exc:
            raise FormatError("meta", f"a string meta must hold a JSON object: {exc.msg}", WRONG_TYPE) from None
    if not isinstance(meta, dict):
        raise FormatError("meta", f"expected an object, got {_type_name(meta)}", WRONG_TYPE)
    meta = dict(meta)
    # Unknown keys are carried in meta rather than dropped, so a later stage (or a person) still sees them.
    for key in sorted(set(raw) - _COMMON_KEYS - _FORMAT_KEYS[fmt]):
        if key in meta:
            raise FormatError(key, "present both as a top-level key and inside `meta`", INVALID_VALUE)
        meta[key] = raw[key]
    return meta


def _tags(raw: dict, fmt: str) -> dict[str, Any]:
    tags: dict[str, Any] = {"meta": _meta(raw, fmt)}
    if "id" in raw:
        value = raw["id"]
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise FormatError("id", f"expected a string, got {_type_name(value)}", WRONG_TYPE)
        tags["id"] = str(value)
        if not tags["id"].strip():
            raise FormatError("id", "is empty", INVALID_VALUE)
    if "tier" in raw:
        tier = raw["tier"]
        if isinstance(tier, float) and tier.is_integer():
            tier = int(tier)
        if isinstance(tier, bool) or not isinstance(tier, int):
            raise FormatError("tier", f"expected an integer 1-3, got {_type_name(raw['tier'])}", WRONG_TYPE)
        if tier not in (1, 2, 3):
            raise FormatError("tier", f"must be 1, 2 or 3, got {tier}", INVALID_VALUE)
        tags["tier"] = tier
    if "difficulty" in raw:
        tags["difficulty"] = _number(raw["difficulty"], "difficulty")
    if "kind" in raw:
        kind = _string(raw["kind"], "kind")
        if kind != FORMAT_KIND[fmt]:
            raise FormatError("kind", f"says {kind!r} but the record is in the {fmt!r} format "
                              f"({FORMAT_KIND[fmt]!r} records)", WRONG_KIND)
    return tags


# -------------------------------------------------------------------------------------- converters


def _from_messages(raw: dict) -> SFTExample:
    messages = _messages(_require(raw, "messages"), "messages")
    _need_assistant(messages, "messages")
    return SFTExample(messages=messages, **_tags(raw, "messages"))


def _from_sharegpt(raw: dict) -> SFTExample:
    messages = _messages(_require(raw, "conversations"), "conversations", "from", "value", SHAREGPT_ROLES)
    _need_assistant(messages, "conversations")
    return SFTExample(messages=messages, **_tags(raw, "sharegpt"))


def _from_alpaca(raw: dict) -> SFTExample:
    instruction = _nonempty(_string(_require(raw, "instruction"), "instruction"), "instruction", EMPTY_PROMPT)
    extra_input = _string(raw.get("input", ""), "input")
    output = _nonempty(_string(_require(raw, "output"), "output"), "output")
    # Alpaca's own prompt puts the input after the instruction, separated by a blank line.
    user_text = f"{instruction}\n\n{extra_input}" if extra_input.strip() else instruction
    messages = [Message(role="user", content=user_text), Message(role="assistant", content=output)]
    if "system" in raw:
        messages.insert(0, Message(role="system", content=_string(raw["system"], "system")))
    return SFTExample(messages=messages, **_tags(raw, "alpaca"))


def _preference_extras(raw: dict) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if "rationale" in raw:
        extras["rationale"] = _string(raw["rationale"], "rationale")
    for ours, theirs in (("chosen_score", "score_chosen"), ("rejected_score", "score_rejected")):
        if ours in raw and theirs in raw:
            raise FormatError(theirs, f"give either `{ours}` or `{theirs}`, not both", INVALID_VALUE)
        for key in (ours, theirs):
            if key in raw:
                extras[ours] = _number(raw[key], key)
    return extras


def _check_pair(chosen: list[Message], rejected: list[Message]) -> None:
    if [m.model_dump() for m in chosen] == [m.model_dump() for m in rejected]:
        raise FormatError("rejected", "is identical to `chosen`: the pair carries no preference", IDENTICAL_PAIR)


def _from_preference(raw: dict) -> PreferencePair:
    prompt_text = _string(_require(raw, "prompt"), "prompt")
    prompt = [Message(role="user", content=_nonempty(prompt_text, "prompt", EMPTY_PROMPT))]
    chosen = [Message(role="assistant", content=_nonempty(_string(_require(raw, "chosen"), "chosen"), "chosen"))]
    rejected_text = _string(_require(raw, "rejected"), "rejected")
    rejected = [Message(role="assistant", content=_nonempty(rejected_text, "rejected"))]
    _check_pair(chosen, rejected)
    return PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected,
                          **_preference_extras(raw), **_tags(raw, "preference"))


def _split_implicit_prompt(chosen: list[Message], rejected: list[Message]) -> tuple[list[Message], ...]:
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise FormatError("prompt", "required field is missing (and `chosen`/`rejected` share no leading "
                          "messages to use as the prompt)", MISSING_FIELD)
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _from_preference_conversational(raw: dict) -> PreferencePair:
    chosen = _messages(_require(raw, "chosen"), "chosen")
    rejected = _messages(_require(raw, "rejected"), "rejected")
    if "prompt" in raw:
        prompt = _prompt(raw["prompt"])
    else:
        _check_pair(chosen, rejected)
        prompt, chosen, rejected = _split_implicit_prompt(chosen, rejected)
    _need_assistant(chosen, "chosen")
    _need_assistant(rejected, "rejected")
    _check_pair(chosen, rejected)
    return PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected,
                          **_preference_extras(raw), **_tags(raw, "preference_conversational"))


def _from_rl(raw: dict) -> RLPrompt:
    fields: dict[str, Any] = {"prompt": _prompt(_require(raw, "prompt"))}
    if "answer" in raw:
        answer = raw["answer"]
        # Verifiable answers are often numbers in the source data; the verifier compares text.
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)
        fields["answer"] = _string(answer, "answer")
    for key in ("verifier", "tests", "group"):
        if key in raw:
            fields[key] = _string(raw[key], key)
    return RLPrompt(**fields, **_tags(raw, "rl"))


_CONVERTERS = {
    "messages": _from_messages,
    "sharegpt": _from_sharegpt,
    "alpaca": _from_alpaca,
    "preference": _from_preference,
    "preference_conversational": _from_preference_conversational,
    "rl": _from_rl,
}


def _validation_to_format_error(exc: ValidationError) -> FormatError:
    """Last line of defence: a record-level check our own field checks did not catch first."""
    error = exc.errors()[0]
    loc = error.get("loc", ())
    field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or None
    message = error.get("msg", str(exc)).removeprefix("Value error, ")
    kind = error.get("type", "")
    if kind == "missing":
        category = MISSING_FIELD
    elif kind.endswith("_type") or kind.endswith("_parsing"):
        category = WRONG_TYPE
    elif "empty" in message:
        category = EMPTY_MESSAGE
    elif "identical" in message:
        category = IDENTICAL_PAIR
    else:
        category = INVALID_VALUE
    return FormatError(field, message, category)


def to_record(raw: dict, fmt: str) -> Record:
    """Convert one raw record in format ``fmt`` (or ``"auto"``) to a posttrain record.

    Keeps ``id``/``tier``/``difficulty``/``meta``; unknown keys go into ``meta``. Raises
    ``FormatError`` (a ``ValueError``) naming the field and the reason.
    """
    if not isinstance(raw, dict):
        raise FormatError(None, f"expected a JSON object, got {_type_name(raw)}", NOT_AN_OBJECT)
    if fmt == "auto":
        fmt = detect_format(raw)
    if fmt not in _CONVERTERS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)} or 'auto'")
    try:
        return _CONVERTERS[fmt](_present(raw))
    except ValidationError as exc:
        raise _validation_to_format_error(exc) from None


def record_to_raw(record: Record) -> dict[str, Any]:
    """The JSON-ready dict ``write_records`` stores: the record's own fields, nulls and empty meta omitted."""
    data = record.model_dump(mode="json")
    return {key: value for key, value in data.items() if value is not None and value != {}}
