"""The internal row every curation stage works on, and the conversion from raw JSONL lines.

A row is a chat (``messages``) plus its id, where it came from (file and line), the scores the
stages attach, and the labels they assign. Stages read two flat views of it: ``prompt`` (every
turn before the last assistant reply) and ``response`` (the last assistant reply).

Raw lines never crash the reader: invalid UTF-8, malformed JSON and records of an unknown shape
become ``Drop`` results with a named reason, so the funnel can account for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.records import stable_id

ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_RESPONSE_KEYS = ("response", "completion", "output", "answer_text")


@dataclass
class Drop:
    """Why a stage removed a row: ``reason`` is a short snake_case name counted in the funnel."""

    reason: str
    detail: str = ""


@dataclass
class Row:
    index: int  # position in the whole input (all files), 0-based; fixes the output order
    source: str
    line: int  # 1-based line in ``source``
    id: str
    messages: list[dict[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)
    scores: dict[str, Any] = field(default_factory=dict)
    tier: int | None = None
    difficulty: float | None = None
    intent: str | None = None
    raw_control_chars: int = 0  # control characters removed by normalisation (for the garbled filter)

    def context(self) -> list[dict[str, str]]:
        """The messages before the last assistant reply (all of them when there is none)."""
        last = _last_assistant(self.messages)
        return self.messages[:last] if last >= 0 else self.messages

    @property
    def prompt(self) -> str:
        return "\n".join(m["content"] for m in self.context())

    @property
    def response(self) -> str:
        last = _last_assistant(self.messages)
        return self.messages[last]["content"] if last >= 0 else ""

    def text(self, fields: str) -> str:
        if fields == "prompt":
            return self.prompt
        if fields == "response":
            return self.response
        return f"{self.prompt}\n{self.response}"

    def output_record(self) -> dict[str, Any]:
        """The kept record: an ``SFTExample`` (loadable by SFT) with curation results in ``meta``."""
        meta = dict(self.meta)
        meta["curate"] = {"source": self.source, "line": self.line, "intent": self.intent, "scores": self.scores}
        return {
            "id": self.id,
            "kind": "sft",
            "messages": self.messages,
            "tier": self.tier,
            "difficulty": self.difficulty,
            "meta": meta,
        }

    def dropped_record(self, stage: str, drop: Drop) -> dict[str, Any]:
        return {
            "id": self.id,
            "source": self.source,
            "line": self.line,
            "stage": stage,
            "reason": drop.reason,
            "detail": drop.detail,
            "scores": self.scores,
            "record": {"messages": self.messages, "meta": self.meta},
        }


def _last_assistant(messages: list[dict[str, str]]) -> int:
    for position in range(len(messages) - 1, -1, -1):
        if messages[position]["role"] == "assistant":
            return position
    return -1


class RecordShapeError(ValueError):
    """A JSON object that is not an instruction record; ``reason`` names the problem for the funnel."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(detail)


def as_messages(value: Any, where: str, allow_string: bool = False) -> list[dict[str, str]]:
    if isinstance(value, str) and allow_string:
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        expected = "a string or a non-empty list of messages" if allow_string else "a non-empty list of messages"
        raise RecordShapeError("bad_field", f"`{where}` must be {expected}")
    messages = []
    for position, message in enumerate(value):
        if not isinstance(message, dict):
            raise RecordShapeError("bad_field", f"`{where}[{position}]` is not an object")
        role = message.get("role", _SHAREGPT_ROLES.get(str(message.get("from", "")).lower()))
        content = message.get("content", message.get("value"))
        if role not in ROLES:
            raise RecordShapeError("bad_field", f"`{where}[{position}].role` is {role!r}; expected one of {ROLES}")
        if not isinstance(content, str):
            raise RecordShapeError("bad_field", f"`{where}[{position}].content` is not a string")
        messages.append({"role": role, "content": content})
    return messages


def record_to_chat(record: Any) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """Convert one JSON record to ``(messages, meta)``; raise ``RecordShapeError`` for other shapes.

    Accepted shapes: ``{"messages": [...]}`` (SFT), ``{"prompt": str | messages, "response": str}``
    (also ``completion``/``output``), Alpaca ``{"instruction", "input", "output"}`` and ShareGPT
    ``{"conversations": [{"from", "value"}]}``.
    """
    if not isinstance(record, dict):
        raise RecordShapeError("unknown_format", f"expected a JSON object, got {type(record).__name__}")
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    if "messages" in record:
        return as_messages(record["messages"], "messages"), meta
    if "conversations" in record:
        return as_messages(record["conversations"], "conversations"), meta
    if "instruction" in record:
        instruction, extra = record.get("instruction"), record.get("input") or ""
        output = record.get("output")
        if not isinstance(instruction, str) or not isinstance(extra, str) or not isinstance(output, str):
            raise RecordShapeError("bad_field", "alpaca `instruction`, `input` and `output` must be strings")
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}], meta
    if "prompt" in record:
        messages = as_messages(record["prompt"], "prompt", allow_string=True)
        for key in _RESPONSE_KEYS:
            if key in record:
                if not isinstance(record[key], str):
                    raise RecordShapeError("bad_field", f"`{key}` must be a string")
                return [*messages, {"role": "assistant", "content": record[key]}], meta
        raise RecordShapeError("missing_response", "record has a prompt but no response/completion/output")
    keys = ", ".join(sorted(map(str, record))[:8])
    raise RecordShapeError(
        "unknown_format", f"no messages, conversations, instruction or prompt key (keys: {keys or 'none'})"
    )


def load_json_object(raw: bytes) -> dict[str, Any] | Drop:
    """One JSONL line → its object, or the named ``Drop`` every curation input counts in its funnel."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return Drop("invalid_utf8")
    except (json.JSONDecodeError, RecursionError) as exc:
        return Drop("malformed_json", str(exc)[:200])
    if not isinstance(record, dict):
        return Drop("unknown_format", "expected a JSON object")
    return record


def parse_line(raw: bytes, index: int, source: str, line: int) -> Row | tuple[Drop, str]:
    """A raw JSONL line → a ``Row``, or ``(Drop, text)`` where ``text`` is the line for the dropped file."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        shown = raw.decode("utf-8", "backslashreplace")
        return Drop("invalid_utf8", f"byte {exc.start}: {exc.reason}"), shown
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        return Drop("malformed_json", str(exc)[:200]), text
    # Valid UTF-8 cannot hold a lone surrogate, but a JSON escape (\ud800) can; it could not be written back.
    if "\\ud" in text.lower() and not _encodable(record):
        return Drop("invalid_utf8", "lone surrogate in a \\u escape"), text
    try:
        messages, meta = record_to_chat(record)
    except RecordShapeError as exc:
        return Drop(exc.reason, str(exc)), text
    given = record.get("id")
    row_id = str(given) if isinstance(given, str | int) and str(given) else stable_id(messages, "rec-")
    row = Row(index=index, source=source, line=line, id=row_id, messages=messages, meta=meta)
    tier = record.get("tier")
    if isinstance(tier, int) and 1 <= tier <= 3:
        row.tier = tier
    return row


def _encodable(record: Any) -> bool:
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unparsed_dropped_record(source: str, line: int, stage: str, drop: Drop, text: str) -> dict[str, Any]:
    return {"id": None, "source": source, "line": line, "stage": stage, "reason": drop.reason,
            "detail": drop.detail, "scores": {}, "record": text}  # fmt: skip


def row_to_json(row: Row) -> str:
    return json.dumps(row.__dict__, ensure_ascii=False, separators=(",", ":"))


def row_from_json(text: str) -> Row:
    return Row(**json.loads(text))
