"""The internal row every curation stage works on, and the conversion from raw input lines.

A row is a chat (``messages``) plus its id, where it came from (file and line), the scores the
stages attach, and the labels they assign. Stages read two flat views of it: ``prompt`` (every
turn before the last assistant reply) and ``response`` (the last assistant reply).

Input goes through the data layer, so curation accepts exactly what SFT training accepts:
``posttrain.data.io.parse_json_line`` decodes a line and ``posttrain.data.sft_fields`` takes the fields
of the ``SFTExample`` that ``posttrain.data.formats.convert`` would make of it (messages, ShareGPT,
Alpaca, prompt + completion/response), without building the model. Raw lines never
crash the reader: a line that cannot be used becomes a ``Drop`` whose reason is the funnel name of
the data layer's category (``FUNNEL_REASONS``: ``invalid_utf8``, ``malformed_json``,
``unknown_format``, ``bad_field``, ``empty_response``, ``missing_response``, …), with the data
layer's message (field and reason) as its detail.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.data import formats
from posttrain.data.formats import FormatError
from posttrain.data.io import BadLine, parse_json_line
from posttrain.data.json_text import encode_string
from posttrain.data.sft_fields import sft_fields
from posttrain.data.writers import LINE_ENCODER, json_line


@dataclass
class Drop:
    """Why a stage removed a row: ``reason`` is a short snake_case name counted in the funnel."""

    reason: str
    detail: str = ""


# The data layer's categories (``posttrain.data.formats.CATEGORIES``) → snake_case funnel reasons.
FUNNEL_REASONS = {
    formats.BLANK_LINE: "blank_line",
    formats.INVALID_UTF8: "invalid_utf8",
    formats.MALFORMED_JSON: "malformed_json",
    formats.NOT_AN_OBJECT: "unknown_format",
    formats.UNKNOWN_FORMAT: "unknown_format",
    formats.MISSING_FIELD: "bad_field",
    formats.WRONG_TYPE: "bad_field",
    formats.INVALID_VALUE: "bad_field",
    formats.EMPTY_MESSAGE: "empty_message",
    formats.EMPTY_PROMPT: "empty_prompt",
    formats.EMPTY_RESPONSE: "empty_response",
    formats.IDENTICAL_PAIR: "identical_pair",
    formats.NO_ASSISTANT: "missing_response",
    formats.WRONG_KIND: "wrong_kind",
}


def funnel_reason(category: str, found_kind: str | None = None) -> str:
    """The funnel reason of a data-layer category. An RL prompt (a prompt with nothing to learn from)
    where an SFT record is needed is ``missing_response``, as a chat without an assistant turn is."""
    if category == formats.WRONG_KIND and found_kind == "rl":
        return "missing_response"
    return FUNNEL_REASONS[category]


def drop_for(problem: FormatError | BadLine) -> Drop:
    """The named ``Drop`` for a line the data layer could not decode or convert."""
    if isinstance(problem, BadLine):
        return Drop(funnel_reason(problem.category), problem.reason)
    return Drop(funnel_reason(problem.category, problem.found_kind), str(problem)[:500])


@dataclass
class Row:
    index: int  # position in the whole input (all files), 0-based; fixes the output order
    source: str
    line: int  # 1-based line in ``source`` (row for Parquet files and saved datasets)
    id: str
    messages: list[dict[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)
    scores: dict[str, Any] = field(default_factory=dict)
    tier: int | None = None
    difficulty: float | None = None
    intent: str | None = None
    raw_control_chars: int = 0  # control characters removed by normalisation (for the garbled filter)
    # The message texts known to need no JSON escape: the very str objects decoded from a JSON line without a
    # backslash (``parse_line``; not a text a format conversion built). ``output_line`` writes such a text's UTF-8
    # as it is, skipping the check; a text a stage replaced (normalisation) is another object, and is checked.
    plain_texts: tuple[str, ...] = ()

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
        return {
            "id": self.id,
            "kind": "sft",
            "messages": self.messages,
            "tier": self.tier,
            "difficulty": self.difficulty,
            "meta": self._kept_meta(),
        }

    def _kept_meta(self) -> dict[str, Any]:
        """The record's own ``meta`` with the curation results under ``curate``."""
        return {**self.meta, "curate": {"source": self.source, "line": self.line, "intent": self.intent,
                                        "scores": self.scores}}

    def output_line(self) -> bytes:
        """``json_line(self.output_record())`` in UTF-8, byte for byte, several times faster: the record's frame is
        written here and its chat's pieces by ``TextEncoder.chat_utf8_pieces``, which takes each long text's UTF-8 as
        it is instead of having the generic encoder piece it together and the file encode it again; the line is
        joined once; only ``meta`` goes through that encoder (0.15 s for the 30k records of the near-dup benchmark;
        0.22 s with a join per message)."""
        if type(self.id) is not str:
            return json_line(self.output_record()).encode("utf-8")
        encode = LINE_ENCODER.encode
        tier = "null" if self.tier is None else encode(self.tier)
        difficulty = "null" if self.difficulty is None else encode(self.difficulty)
        pieces = [f'{{"id": {encode_string(self.id)}, "kind": "sft", "messages": '.encode()]
        LINE_ENCODER.chat_utf8_pieces(self.messages, pieces, self.plain_texts)
        pieces.append(f', "tier": {tier}, "difficulty": {difficulty}, "meta": {encode(self._kept_meta())}}}\n'.encode())
        return b"".join(pieces)

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


def row_from_record(raw: dict[str, Any], index: int, source: str, line: int, unescaped: bool = False) -> Row | Drop:
    """A decoded JSON object → a ``Row`` (an SFT record in any format the data layer reads), or a ``Drop``.
    ``unescaped``: no string in ``raw`` needs a JSON escape (``records.messages_id``)."""
    try:
        fields, verbatim = sft_fields(raw, unescaped=unescaped)
    except FormatError as exc:
        return drop_for(exc)
    # Texts a conversion built (a blank line joining an Alpaca instruction and input) are not raw's strings.
    plain = tuple(message["content"] for message in fields.messages) if unescaped and verbatim else ()
    return Row(index, source, line, fields.id, fields.messages, fields.meta, tier=fields.tier,
               difficulty=fields.difficulty, plain_texts=plain)  # fmt: skip


def parse_line(raw: bytes, index: int, source: str, line: int) -> Row | tuple[Drop, str]:
    """A raw JSONL line → a ``Row``, or ``(Drop, text)`` where ``text`` is the line for the dropped file."""
    item = parse_json_line(raw)
    if isinstance(item, BadLine):
        return drop_for(item), item.raw
    # JSON text without a backslash holds no escape, so none of its strings holds a quote, a backslash or a control
    # character (the decoder refuses them unescaped): none needs an escape to be written back.
    parsed = row_from_record(item, index, source, line, unescaped=b"\\" not in raw)
    return (parsed, raw.decode("utf-8").rstrip("\r\n")) if isinstance(parsed, Drop) else parsed


def unparsed_dropped_record(source: str, line: int, stage: str, drop: Drop, text: str) -> dict[str, Any]:
    return {"id": None, "source": source, "line": line, "stage": stage, "reason": drop.reason,
            "detail": drop.detail, "scores": {}, "record": text}  # fmt: skip
