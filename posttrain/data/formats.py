"""External data formats → posttrain records, with detection and errors that name the bad field.

This is the one record parser of the package: training (``read_records``), curation (``posttrain
curate`` / ``sample`` / ``feedback``) and generation (``posttrain generate``) all read records through
it, so they accept the same formats and report the same reasons.

Supported formats (``FORMATS``), and the keys that identify each one in ``detect_format``:

==============================  ============================================  ======================
format                          shape of one record                           becomes
==============================  ============================================  ======================
``messages`` (OpenAI)           ``{"messages": [{"role", "content"}, ...]}``  ``SFTExample``
``sharegpt``                    ``{"conversations": [{"from", "value"}]}``    ``SFTExample``
``alpaca``                      ``{"instruction", "input"?, "output"}``       ``SFTExample``
``prompt_completion`` (TRL)     ``{"prompt": str | [msgs],                    ``SFTExample``
                                "completion" | "response": str | [msgs]}``
``preference`` (TRL standard)   ``{"prompt": str | [msgs], "chosen": str,     ``PreferencePair``
                                "rejected": str}``
``preference_conversational``   ``{"prompt"?: str | [msgs], "chosen": [msgs], ``PreferencePair``
(TRL conversational)            "rejected": [msgs]}``
``hh_rlhf`` (Anthropic)         ``{"chosen": "\\n\\nHuman: …\\n\\nAssistant: …",  ``PreferencePair``
                                "rejected": "…"}`` (no ``prompt``)
``rl``                          ``{"prompt": str | [msgs], "answer"?, ...}``  ``RLPrompt``
==============================  ============================================  ======================

``response`` is accepted as a synonym of TRL's ``completion``: many instruction sets (and posttrain's
own raw task pool) use it, and a prompt with a response is something to learn from, not an RL prompt.
A ``prompt`` without either is an RL prompt. In an SFT example made from ``prompt_completion`` every
assistant turn is a target, including assistant turns inside a conversational ``prompt`` (TRL trains
the completion only); give such data as ``messages`` if that is what you mean.

Every format may also carry ``id`` (string or integer), ``tier`` (1–3), ``difficulty`` (number),
``meta`` (an object, or a JSON-object string as Parquet stores it) and ``kind`` (``sft`` /
``preference`` / ``rl``, written by ``write_records``; checked against the format). Preference
records may carry ``rationale`` (the annotator's reason) and ``chosen_score`` / ``rejected_score``
(``score_chosen`` / ``score_rejected`` as in UltraFeedback are accepted too). Keys a format does not
know are kept, not dropped: they go into ``meta`` under their own name. A key whose value is
``null`` counts as absent (Parquet fills missing columns with nulls).

A conversational preference record without ``prompt`` (TRL's *implicit prompt*) and an HH-RLHF pair
are split at the first message where ``chosen`` and ``rejected`` differ; the shared messages become
the prompt.

Conversion errors are ``FormatError``: they carry the field path in the input's own terms
(``conversations[2].value``), a human reason, and a short ``category`` used to count bad records. A
record of a known format that belongs to another recipe (an RL prompt given to SFT) gets
``WRONG_KIND`` and a message that says what the record is and how to convert it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pydantic import ValidationError

from posttrain.data.kind_hints import wrong_kind_message
from posttrain.data.records import (
    ASSISTANT_FIRST,
    Message,
    PreferencePair,
    Record,
    RLPrompt,
    SFTExample,
    starts_with_assistant,
)

FORMAT_KIND = {
    "messages": "sft",
    "sharegpt": "sft",
    "alpaca": "sft",
    "prompt_completion": "sft",
    "preference": "preference",
    "preference_conversational": "preference",
    "hh_rlhf": "preference",
    "rl": "rl",
}
FORMATS: tuple[str, ...] = tuple(FORMAT_KIND)

# Categories used to count bad records by reason (``ReadReport.reasons``, the curation funnel).
BLANK_LINE = "blank line"
MALFORMED_JSON = "malformed JSON"
INVALID_UTF8 = "invalid UTF-8"
NOT_AN_OBJECT = "not a JSON object"
UNKNOWN_FORMAT = "unknown format"
MISSING_FIELD = "missing field"
WRONG_TYPE = "wrong type"
INVALID_VALUE = "invalid value"
EMPTY_MESSAGE = "empty message"  # a chat turn with no text
EMPTY_PROMPT = "empty prompt"
EMPTY_RESPONSE = "empty response"  # a response given as plain text (`output`, `completion`, `chosen`) is empty
IDENTICAL_PAIR = "identical chosen/rejected"
NO_ASSISTANT = "no assistant turn"
WRONG_KIND = "wrong record kind"
CATEGORIES: tuple[str, ...] = (
    BLANK_LINE, MALFORMED_JSON, INVALID_UTF8, NOT_AN_OBJECT, UNKNOWN_FORMAT, MISSING_FIELD, WRONG_TYPE,
    INVALID_VALUE, EMPTY_MESSAGE, EMPTY_PROMPT, EMPTY_RESPONSE, IDENTICAL_PAIR, NO_ASSISTANT, WRONG_KIND,
)  # fmt: skip

# The one role map for chats that name roles in their own words (ShareGPT's `from`).
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
_PREFERENCE_KEYS = {"prompt", "chosen", "rejected", "rationale", "chosen_score", "rejected_score", "score_chosen",
                    "score_rejected"}  # fmt: skip
_FORMAT_KEYS = {
    "messages": {"messages"},
    "sharegpt": {"conversations"},
    "alpaca": {"instruction", "input", "output", "system"},
    "prompt_completion": {"prompt", "completion", "response"},
    "preference": _PREFERENCE_KEYS,
    "preference_conversational": _PREFERENCE_KEYS,
    "hh_rlhf": _PREFERENCE_KEYS - {"prompt"},
    "rl": {"prompt", "answer", "verifier", "tests", "group"},
}
RESPONSE_KEYS = ("completion", "response")
# Every key a format reads; the others go into `meta` (``posttrain.data.sft_fields`` reads records with these too).
KNOWN_KEYS = {fmt: frozenset(_COMMON_KEYS | keys) for fmt, keys in _FORMAT_KEYS.items()}


class FormatError(ValueError):
    """A record does not fit its format. ``field`` is a path in the input's terms, or None.

    ``found_kind`` is set for ``WRONG_KIND``: the kind the record actually is (``"rl"`` for an RL prompt).
    """

    def __init__(self, field: str | None, reason: str, category: str, found_kind: str | None = None):
        self.field, self.reason, self.category, self.found_kind = field, reason, category, found_kind
        super().__init__(f"`{field}`: {reason}" if field else reason)


def _present(raw: dict) -> dict:
    """The record without null-valued keys: a null means "absent" (Parquet nulls, optional columns)."""
    return {key: value for key, value in raw.items() if value is not None}


def detect_format(raw: dict) -> str:
    """Name the format of one raw record from its keys; raise ``FormatError`` naming the keys seen."""
    if not isinstance(raw, dict):
        raise FormatError(None, f"expected a JSON object, got {type(raw).__name__}", NOT_AN_OBJECT)
    keys = _present(raw)
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if "chosen" in keys or "rejected" in keys:
        sample = keys.get("chosen", keys.get("rejected"))
        if isinstance(sample, list):
            return "preference_conversational"
        # Without a prompt, a text `chosen` is a whole transcript: Anthropic's HH-RLHF layout.
        return "preference" if "prompt" in keys else "hh_rlhf"
    if "instruction" in keys:
        if "output" not in keys:
            raise FormatError("output", "required field is missing (an Alpaca record has `instruction`, `input` and "
                              "`output`)", MISSING_FIELD)  # fmt: skip
        return "alpaca"
    if "prompt" in keys:
        return "prompt_completion" if any(key in keys for key in RESPONSE_KEYS) else "rl"
    seen = ", ".join(sorted(map(str, keys))) or "none"
    raise FormatError(
        None,
        f"cannot tell the format from the keys ({seen}); expected `messages` (OpenAI), `conversations` "
        "(ShareGPT), `instruction`+`output` (Alpaca), `prompt`+`completion` (or `response`; SFT), "
        "`prompt`+`chosen`+`rejected` (preference), `chosen`+`rejected` transcripts (HH-RLHF) or `prompt` (RL)",
        UNKNOWN_FORMAT,
    )


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


def parse_prompt(value: Any, field: str = "prompt") -> list[Message]:
    """A prompt given as plain text (one user message) or as a list of messages."""
    if isinstance(value, str):
        return [Message(role="user", content=_nonempty(value, field, EMPTY_PROMPT))]
    if not isinstance(value, list):
        raise FormatError(field, f"expected a string or a list of messages, got {_type_name(value)}", WRONG_TYPE)
    if not value:
        raise FormatError(field, "is empty", EMPTY_PROMPT)
    return _messages(value, field)


def _response(value: Any, field: str) -> list[Message]:
    """A response given as plain text (one assistant message) or as a list of messages with an assistant turn."""
    if isinstance(value, str):
        return [Message(role="assistant", content=_nonempty(value, field, EMPTY_RESPONSE))]
    if not isinstance(value, list):
        raise FormatError(field, f"expected a string or a list of messages, got {_type_name(value)}", WRONG_TYPE)
    messages = _messages(value, field)
    _need_assistant(messages, field)
    return messages


def _need_assistant(messages: list[Message], field: str, what: str = "has no assistant message to learn from") -> None:
    if not any(m.role == "assistant" for m in messages):
        raise FormatError(field, what, NO_ASSISTANT)


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
    for key in sorted(set(raw) - KNOWN_KEYS[fmt]):
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
                              f"({FORMAT_KIND[fmt]!r} records)", WRONG_KIND, found_kind=FORMAT_KIND[fmt])
    return tags


# ------------------------------------------------------------------------------- prompts of SFT formats


def _chat(raw: dict, fmt: str) -> tuple[list[Message], str]:
    """The chat of a ``messages`` or ``sharegpt`` record and its field name (no assistant turn required)."""
    if fmt == "sharegpt":
        return _messages(_require(raw, "conversations"), "conversations", "from", "value", SHAREGPT_ROLES), "conversations"
    return _messages(_require(raw, "messages"), "messages"), "messages"


def _alpaca_prompt(raw: dict) -> list[Message]:
    instruction = _nonempty(_string(_require(raw, "instruction"), "instruction"), "instruction", EMPTY_PROMPT)
    extra_input = _string(raw.get("input", ""), "input")
    # Alpaca's own prompt puts the input after the instruction, separated by a blank line.
    messages = [Message(role="user", content=f"{instruction}\n\n{extra_input}" if extra_input.strip() else instruction)]
    if "system" in raw:
        messages.insert(0, Message(role="system", content=_string(raw["system"], "system")))
    return messages


def _completion_key(raw: dict) -> str:
    if all(key in raw for key in RESPONSE_KEYS):
        raise FormatError("response", "give either `completion` or `response`, not both", INVALID_VALUE)
    return next((key for key in RESPONSE_KEYS if key in raw), "completion")


# -------------------------------------------------------------------------------------- converters


def _need_prompt_first(messages: list[Message], role_field: str) -> None:
    if starts_with_assistant(messages):  # EMPTY_PROMPT: the first assistant turn has nothing to answer
        raise FormatError(role_field, ASSISTANT_FIRST, EMPTY_PROMPT)


def _from_chat(raw: dict, fmt: str) -> SFTExample:
    messages, field = _chat(raw, fmt)
    _need_assistant(messages, field)
    _need_prompt_first(messages, f"{field}[0].{'from' if fmt == 'sharegpt' else 'role'}")
    return SFTExample(messages=messages, **_tags(raw, fmt))


def _from_alpaca(raw: dict) -> SFTExample:
    prompt = _alpaca_prompt(raw)
    output = _nonempty(_string(_require(raw, "output"), "output"), "output", EMPTY_RESPONSE)
    return SFTExample(messages=[*prompt, Message(role="assistant", content=output)], **_tags(raw, "alpaca"))


def _from_prompt_completion(raw: dict) -> SFTExample:
    key = _completion_key(raw)
    prompt = parse_prompt(_require(raw, "prompt"))
    _need_prompt_first(prompt, "prompt[0].role")
    completion = _response(_require(raw, key), key)
    return SFTExample(messages=[*prompt, *completion], **_tags(raw, "prompt_completion"))


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


def _split_shared_prompt(chosen: list[Message], rejected: list[Message], none_shared: str,
                         category: str) -> tuple[list[Message], ...]:  # fmt: skip
    """``(prompt, chosen, rejected)``: the leading messages both sides share become the prompt."""
    _check_pair(chosen, rejected)
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise FormatError("prompt", none_shared, category)
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _from_preference(raw: dict, fmt: str) -> PreferencePair:
    """TRL standard and conversational pairs: a prompt (text or chat), responses as text or as chats.
    Only the conversational layout may leave the prompt implicit."""
    prompt = parse_prompt(_require(raw, "prompt")) if fmt == "preference" or "prompt" in raw else None
    chosen, rejected = _response(_require(raw, "chosen"), "chosen"), _response(_require(raw, "rejected"), "rejected")
    if prompt is None:
        prompt, chosen, rejected = _split_shared_prompt(
            chosen, rejected, "required field is missing (and `chosen`/`rejected` share no leading messages to use "
            "as the prompt)", MISSING_FIELD)  # fmt: skip
        _need_assistant(chosen, "chosen", "has no assistant message after the shared prompt")
        _need_assistant(rejected, "rejected", "has no assistant message after the shared prompt")
    _check_pair(chosen, rejected)
    return PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected, **_preference_extras(raw),
                          **_tags(raw, fmt))  # fmt: skip


# Turn markers of Anthropic's HH-RLHF transcripts; "\n\nHuman:" inside a turn's text would be a new turn there too.
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def hh_turns(text: Any, field: str) -> list[Message]:
    """Split an HH-RLHF transcript (``"\\n\\nHuman: …\\n\\nAssistant: …"``) into messages; errors name ``field``."""
    text = _string(text, field)
    if text.startswith(("Human:", "Assistant:")):  # some copies lost the leading blank line
        text = "\n\n" + text
    parts = _HH_TURN.split(text)
    if len(parts) == 1:
        raise FormatError(field, "has no `\\n\\nHuman:` / `\\n\\nAssistant:` turns (a text `chosen`/`rejected` "
                          "without `prompt` is read as an Anthropic HH-RLHF transcript; give `prompt` for the TRL "
                          "standard preference format)", INVALID_VALUE)  # fmt: skip
    if parts[0].strip():
        raise FormatError(field, f"has text before its first turn ({parts[0].strip()[:40]!r}); an HH-RLHF transcript "
                          "starts with `\\n\\nHuman:`", INVALID_VALUE)  # fmt: skip
    messages = []
    for index in range(1, len(parts), 2):
        speaker, content = parts[index], parts[index + 1].strip()
        turn = index // 2
        if not content:
            raise FormatError(f"{field}[{turn}]", f"turn {turn + 1} (`{speaker}:`) is empty", EMPTY_MESSAGE)
        if "\x00" in content:
            raise FormatError(f"{field}[{turn}]", "contains a NUL character", INVALID_VALUE)
        messages.append(Message(role=_HH_ROLES[speaker], content=content))
    _need_assistant(messages, field, "has no `\\n\\nAssistant:` turn: nothing to prefer")
    return messages


def _from_hh_rlhf(raw: dict) -> PreferencePair:
    chosen, rejected = hh_turns(_require(raw, "chosen"), "chosen"), hh_turns(_require(raw, "rejected"), "rejected")
    prompt, chosen, rejected = _split_shared_prompt(
        chosen, rejected, "`chosen` and `rejected` share no leading turns, so there is no prompt: an HH-RLHF pair is "
        "two transcripts of one conversation that differ from some `Assistant:` reply on", EMPTY_PROMPT)  # fmt: skip
    _need_assistant(chosen, "chosen", "has no `Assistant:` turn after the turns it shares with `rejected`")
    _need_assistant(rejected, "rejected", "has no `Assistant:` turn after the turns it shares with `chosen`")
    return PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected, **_preference_extras(raw),
                          **_tags(raw, "hh_rlhf"))  # fmt: skip


def _rl_fields(raw: dict) -> dict[str, Any]:
    fields: dict[str, Any] = {"prompt": parse_prompt(_require(raw, "prompt"))}
    if "answer" in raw:
        answer = raw["answer"]
        # Verifiable answers are often numbers in the source data; the verifier compares text.
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)
        fields["answer"] = _string(answer, "answer")
    for key in ("verifier", "tests", "group"):
        if key in raw:
            fields[key] = _string(raw[key], key)
    return fields


def _from_rl(raw: dict) -> RLPrompt:
    return RLPrompt(**_rl_fields(raw), **_tags(raw, "rl"))


_CONVERTERS = {
    "messages": lambda raw: _from_chat(raw, "messages"),
    "sharegpt": lambda raw: _from_chat(raw, "sharegpt"),
    "alpaca": _from_alpaca,
    "prompt_completion": _from_prompt_completion,
    "preference": lambda raw: _from_preference(raw, "preference"),
    "preference_conversational": lambda raw: _from_preference(raw, "preference_conversational"),
    "hh_rlhf": _from_hh_rlhf,
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


def _resolve(raw: Any, fmt: str) -> str:
    if not isinstance(raw, dict):
        raise FormatError(None, f"expected a JSON object, got {_type_name(raw)}", NOT_AN_OBJECT)
    if fmt == "auto":
        return detect_format(raw)
    if fmt not in _CONVERTERS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)} or 'auto'")
    return fmt


def to_record(raw: dict, fmt: str) -> Record:
    """Convert one raw record in format ``fmt`` (or ``"auto"``) to a posttrain record.

    Keeps ``id``/``tier``/``difficulty``/``meta``; unknown keys go into ``meta``. Raises
    ``FormatError`` (a ``ValueError``) naming the field and the reason.
    """
    fmt = _resolve(raw, fmt)
    try:
        return _CONVERTERS[fmt](_present(raw))
    except ValidationError as exc:
        raise _validation_to_format_error(exc) from None


# ------------------------------------------------------------------------ records of another recipe


def convert(raw: dict, fmt: str = "auto", kind: str | None = None) -> tuple[Record, str]:
    """``(record, format used)`` for one raw record; with ``kind``, a record of another kind is a ``FormatError``
    (category ``WRONG_KIND``, ``found_kind`` set) whose message says how to convert it."""
    used = _resolve(raw, fmt)
    if kind is not None and FORMAT_KIND[used] != kind:
        found = FORMAT_KIND[used]
        raise FormatError(None, wrong_kind_message(used, found, kind, raw), WRONG_KIND, found_kind=found)
    return to_record(raw, used), used


def to_prompt(raw: dict, fmt: str = "auto") -> tuple[RLPrompt, str]:
    """The prompt of any record, as an ``RLPrompt``: what to sample a response for.

    RL records convert as they are. A chat's prompt is its turns before the trailing assistant
    reply (a chat with no assistant turn is all prompt); Alpaca's is the instruction (+ input);
    ``prompt_completion`` and preference records give their ``prompt`` (HH-RLHF: the shared turns).
    Other fields of an SFT or preference record (``answer`` keys included) end up in ``meta``.
    """
    used = _resolve(raw, fmt)
    present = _present(raw)
    try:
        if used == "rl":
            return _from_rl(present), used
        if used in ("messages", "sharegpt"):
            messages, field = _chat(present, used)
            while messages and messages[-1].role == "assistant":
                messages.pop()
            if not messages:
                raise FormatError(field, "has no turns before the assistant reply: nothing to prompt with", EMPTY_PROMPT)
        elif used == "alpaca":
            messages = _alpaca_prompt(present)
        elif used == "prompt_completion":
            messages = parse_prompt(_require(present, "prompt"))
        else:
            messages = to_record(present, used).prompt  # type: ignore[union-attr]
        return RLPrompt(prompt=messages, **_tags(present, used)), used
    except ValidationError as exc:
        raise _validation_to_format_error(exc) from None


def record_to_raw(record: Record) -> dict[str, Any]:
    """The JSON-ready dict ``write_records`` stores: the record's own fields, nulls and empty meta omitted."""
    data = record.model_dump(mode="json")
    return {key: value for key, value in data.items() if value is not None and value != {}}
