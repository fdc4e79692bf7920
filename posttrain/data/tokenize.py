"""Chat-template tokenisation with assistant-only loss masks that do not need ``{% generation %}``.

Rendering and encoding live in ``posttrain.data.chat`` (shared with generation); this module finds
which tokens to train. For each trained assistant message ``i``:

1. Render ``messages[:i]`` with ``add_generation_prompt=True`` (the *prompt*: the text up to where the
   model starts writing) and ``messages[:i+1]`` without it (the turn's *own view*: the conversation as
   the template shows it right after the model wrote turn ``i``). The prompt must be a prefix of the own
   view, or the template renders a turn differently when it is generated than when it is history and
   no mask is right: ``TemplateError``.
2. The trained text starts where the prompt ends and ends just after the template's end-of-turn text
   (``chat_facts(tokenizer).end_of_turn``, found from the template itself: ``<|im_end|>``,
   ``<|eot_id|>``, ``<|end|>``, ``</s>``, ``<end_of_turn>`` …, whether or not it is the tokenizer's EOS).
   What the template appends after the last message only (its *tail*, e.g. Phi-3's EOS) and the
   whitespace between turns are not trained. If the probe conversation cannot be rendered, the turn
   ends after the tokenizer's EOS when the turn contains it, else at its last non-space character.
3. The turn goes into the first *row* whose text agrees with its own view up to the turn's end; the
   first row is the whole conversation rendered once. Templates that render every turn the same way
   later on (most) give one row per chat. Templates that rewrite earlier turns (Qwen3 strips the
   reasoning of past assistant turns) give a turn that the whole rendering shows differently a row of
   its own: its own view, so every turn is trained on exactly the text the model saw and wrote when it
   produced it. ``tokenize_chat_rows`` and ``tokenize_records`` return such rows; ``tokenize_chat`` and
   ``tokenize_prompt_completion`` return one example and raise ``TemplateError`` when one is not enough.
4. Each row is encoded once (``chat.encode_at_cuts``, cut where each trained turn starts, so the ids
   before a turn are the ids of its prompt encoded alone: ``chat.encode_prompt(prompt)`` is exactly the
   part of ``tokenize_prompt_completion(prompt, completion).input_ids`` before the first trained token), and
   every token with a character inside a trained span is labelled (``labels = input_ids`` there,
   ``IGNORE_INDEX`` elsewhere). The tokenizer's implicit BOS is prepended when the template did not
   render it; special tokens are never added twice.

Truncation is explicit and counted (``TokenizedExample.truncated``, ``TokenizeReport``):

- ``tokenize_chat``: ``truncation_side="right"`` keeps the first ``max_length`` tokens, ``"left"``
  keeps the last ``max_length``.
- ``tokenize_prompt_completion`` (preference pairs, RL): the completion is kept whole while it fits;
  the prompt is cut first, from the ``truncation_side`` end (``"left"`` drops its oldest tokens,
  ``"right"`` drops the tokens just before the completion). Only when the completion alone exceeds
  ``max_length`` is the prompt dropped entirely and the completion cut from the right.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.data import chat as chat_text
from posttrain.data.chat import (
    ChatFacts,
    Segment,
    TemplateError,
    as_message_dicts,
    chat_facts,
    encode_at_cuts,
    render_chats,
    with_implicit_prefix,
)
from posttrain.data.records import Message, PreferencePair, SFTExample, stable_id
from posttrain.models.logprobs import IGNORE_INDEX
from posttrain.progress import progress as progress_bar

TruncationSide = Literal["left", "right"]

__all__ = [
    "IGNORE_INDEX",
    "TemplateError",
    "TokenizedExample",
    "TokenizeReport",
    "tokenize_chat",
    "tokenize_chat_rows",
    "tokenize_prompt_completion",
    "tokenize_preference",
    "tokenize_records",
    "render_prompt",
]


@dataclass
class TokenizedExample:
    input_ids: list[int]
    labels: list[int]
    truncated: bool
    id: str
    tier: int | None = None
    difficulty: float | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


@dataclass
class TokenizeReport:
    """Counts for a tokenised dataset: how many examples were truncated and how many tokens that cost."""

    examples: int = 0  # rows produced (more than records when a template rewrites earlier turns)
    truncated: int = 0
    tokens: int = 0
    tokens_dropped: int = 0
    target_tokens: int = 0
    no_targets: int = 0  # examples left with no trained token (e.g. truncation cut every assistant turn)
    max_length: int = 0
    truncation_side: str = "right"
    lengths: list[int] = field(default_factory=list, repr=False)  # untruncated lengths
    records: int = 0

    def summary(self) -> str:
        text = f"tokenised {self.examples} examples"
        if self.examples != self.records:
            text += (f" from {self.records} records ({self.examples - self.records} extra rows: the chat template "
                     "rewrites earlier turns, so those turns are trained on their own rendering)")
        text += (f": {self.tokens} tokens, {self.target_tokens} trained; truncated {self.truncated} at max_length "
                 f"{self.max_length} ({self.truncation_side} side, {self.tokens_dropped} tokens dropped)")
        if self.no_targets:
            text += f"; {self.no_targets} example(s) have no trained token left"
        return text


def render_prompt(messages: Sequence[Message | dict[str, Any]], tokenizer) -> str:
    """The text a model continues from to answer ``messages``; ``posttrain.data.chat.render_prompt`` with
    this module's historical argument order (messages first)."""
    return chat_text.render_prompt(tokenizer, list(messages))


# ------------------------------------------------------------------------------------- planning


@dataclass
class _Conversation:
    """A conversation to tokenise and the indices of the assistant messages to train."""

    messages: list[dict[str, Any]]
    trained: list[int]
    id: str
    tier: int | None = None
    difficulty: float | None = None


@dataclass
class _Row:
    """One rendering of a chat and the character spans ``[start, end)`` of the turns trained on it."""

    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)  # message index of each span


def _as_chat(record_or_messages: SFTExample | Sequence[Message | dict[str, Any]]) -> _Conversation:
    if isinstance(record_or_messages, SFTExample):
        record = record_or_messages
        messages = as_message_dicts(record.messages)
        example_id, tier, difficulty = record.id, record.tier, record.difficulty
    else:
        messages = as_message_dicts(record_or_messages)
        example_id, tier, difficulty = stable_id(messages, "sft-"), None, None
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return _Conversation(messages, trained, example_id, tier, difficulty)


def _turn_end(turn: str, facts: ChatFacts, eos_token: str | None) -> int | None:
    """Where the trained text of an assistant turn (rendered as the last message, from the end of its
    prompt on) stops; ``None`` when the turn lacks the template's end-of-turn text."""
    if facts.tail and turn.endswith(facts.tail):
        turn = turn[: len(turn) - len(facts.tail)]
    if facts.end_of_turn is None:  # the template refused the probe conversation
        if eos_token and eos_token in turn:
            return turn.index(eos_token) + len(eos_token)
        return len(turn.rstrip())
    if not facts.end_of_turn:  # the template writes nothing after a turn but whitespace
        return len(turn.rstrip())
    at = turn.rfind(facts.end_of_turn)
    return None if at < 0 else at + len(facts.end_of_turn)


def _place_turn(rows: list[_Row], conversation: _Conversation, index: int, prompt: str, view: str,
                facts: ChatFacts, eos_token: str | None) -> None:
    """Add assistant turn ``index`` (its prompt and own view rendered) to the first row that shows it as its
    own view does, or to a new row holding its own view."""
    if not view.startswith(prompt):
        raise TemplateError(
            f"the chat template is not prefix-consistent at message {index} of {conversation.id}: the prompt "
            "(the conversation before the turn, with the generation prompt) is not a prefix of the "
            "conversation rendered through the turn, so the template renders a turn differently when it "
            "is generated than when it is history and no loss mask matches what the model would see."
        )
    end = _turn_end(view[len(prompt):], facts, eos_token)
    if end is None:
        raise TemplateError(
            f"assistant message {index} of {conversation.id} does not end with the template's end-of-turn text "
            f"{facts.end_of_turn!r} (found by rendering a probe conversation), so where its trained text "
            "stops is unknown."
        )
    start, end = len(prompt), len(prompt) + end
    if end == start:
        return  # an empty turn with no end-of-turn text: nothing to train
    for row in rows:
        if row.text.startswith(view[:end]):
            row.spans.append((start, end))
            row.turns.append(index)
            return
    rows.append(_Row(view, [(start, end)], [index]))


def _plan_rows(tokenizer, conversations: list[_Conversation], facts: ChatFacts) -> list[list[_Row]]:
    """The rows of each chat. Renders each chat once whole, and each trained turn's prompt and (unless
    the turn is the last message, whose view is the whole chat) its own view, in two batched calls."""
    prompts, prompt_names, views, view_names = [], [], [], []
    for conversation in conversations:
        views.append(conversation.messages)
        view_names.append(f"{conversation.id} (whole chat)")
        for index in conversation.trained:
            if index == 0:
                raise TemplateError(
                    f"message 0 of {conversation.id} is an assistant turn: there is no prompt before it to render, so "
                    "where its text starts is unknown. Put the user message it answers before it, or drop it."
                )
            prompts.append(conversation.messages[:index])
            prompt_names.append(f"{conversation.id} messages[:{index}] (with the generation prompt)")
            if index + 1 < len(conversation.messages):
                views.append(conversation.messages[: index + 1])
                view_names.append(f"{conversation.id} messages[:{index + 1}]")
    prompt_texts = iter(render_chats(tokenizer, prompts, True, prompt_names))
    view_texts = iter(render_chats(tokenizer, views, False, view_names))
    eos_token = getattr(tokenizer, "eos_token", None)
    planned = []
    for conversation in conversations:
        rows = [_Row(next(view_texts))]
        for index in conversation.trained:
            prompt = next(prompt_texts)
            view = next(view_texts) if index + 1 < len(conversation.messages) else rows[0].text
            _place_turn(rows, conversation, index, prompt, view, facts, eos_token)
        with_turns = sorted((row for row in rows if row.spans), key=lambda row: row.turns[0])
        planned.append(with_turns or rows[:1])
    return planned


# ------------------------------------------------------------------------------------- encoding


def _label_segment(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """The token id where a token overlaps one of ``spans`` (same coordinates as ``offsets``), else ignored."""
    labels = [IGNORE_INDEX] * len(ids)
    span_index = 0
    for position, (start, end) in enumerate(offsets):
        end = max(end, start + 1)  # a zero-width token counts at its position
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index == len(spans):
            break
        if start < spans[span_index][1] and end > spans[span_index][0]:
            labels[position] = ids[position]
    return labels


def _mask(segments: list[Segment], spans: list[tuple[int, int]], prefix: Sequence[int]
          ) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of an encoded row: labels on the tokens that overlap a span, the implicit
    prefix (BOS) in front, untrained, unless the rendering starts with it."""
    ids: list[int] = []
    labels: list[int] = []
    for seg_start, seg_ids, offsets in segments:
        seg_end = seg_start + (offsets[-1][1] if offsets else 0)
        local = [(start - seg_start, end - seg_start) for start, end in spans if start < seg_end and end > seg_start]
        ids += seg_ids
        labels += _label_segment(seg_ids, offsets, local) if local else [IGNORE_INDEX] * len(seg_ids)
    full_ids = with_implicit_prefix(ids, prefix)
    return full_ids, [IGNORE_INDEX] * (len(full_ids) - len(ids)) + labels


def _encode_rows(tokenizer, rows: list[_Row], facts: ChatFacts) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` for each row, in one batched encoding."""
    encoded = encode_at_cuts(tokenizer, [row.text for row in rows],
                                  [[start for start, _ in row.spans] for row in rows], facts)
    return [_mask(segments, row.spans, facts.implicit_prefix) for row, segments in zip(rows, encoded, strict=True)]


def _row_id(conversation: _Conversation, row: _Row, rows: list[_Row]) -> str:
    """The chat's id, or ``<id>/turn<i>`` (``i``: the first message it trains) when the chat has several rows."""
    return conversation.id if len(rows) == 1 else f"{conversation.id}/turn{row.turns[0]}"


def _check_side(truncation_side: str) -> None:
    if truncation_side not in ("left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")


def _truncate_chat(ids: list[int], labels: list[int], max_length: int, side: str) -> tuple[list[int], list[int]]:
    keep = slice(0, max_length) if side == "right" else slice(len(ids) - max_length, None)
    return ids[keep], labels[keep]


def _tokenize_chats(tokenizer, conversations: list[_Conversation], max_length: int, truncation_side: str,
                    facts: ChatFacts) -> list[list[tuple[TokenizedExample, int]]]:
    """The rows of each chat as ``(example, untruncated length)``, truncated as SFT conversations are."""
    planned = _plan_rows(tokenizer, conversations, facts)
    encoded = iter(_encode_rows(tokenizer, [row for rows in planned for row in rows], facts))
    out = []
    for conversation, rows in zip(conversations, planned, strict=True):
        examples = []
        for row in rows:
            ids, labels = next(encoded)
            length, truncated = len(ids), len(ids) > max_length
            if truncated:
                ids, labels = _truncate_chat(ids, labels, max_length, truncation_side)
            example_id = _row_id(conversation, row, rows)
            example = TokenizedExample(ids, labels, truncated, example_id, conversation.tier, conversation.difficulty)
            examples.append((example, length))
        out.append(examples)
    return out


# ------------------------------------------------------------------------------------- public API


def tokenize_chat_rows(
    record_or_messages: SFTExample | Sequence[Message | dict[str, Any]],
    tokenizer,
    max_length: int,
    truncation_side: TruncationSide = "right",
) -> list[TokenizedExample]:
    """Tokenise a chat into training rows: one row for templates that render earlier turns the same way
    later (most), one more per turn the template rewrites once later turns follow (see the module
    docstring). Each row trains its assistant turns (content + end-of-turn token); ids are the record's
    id, or ``<id>/turn<i>`` when there are several rows."""
    _check_side(truncation_side)
    [rows] = _tokenize_chats(tokenizer, [_as_chat(record_or_messages)], max_length, truncation_side,
                             chat_facts(tokenizer))
    return [example for example, _ in rows]


def tokenize_chat(
    record_or_messages: SFTExample | Sequence[Message | dict[str, Any]],
    tokenizer,
    max_length: int,
    truncation_side: TruncationSide = "right",
) -> TokenizedExample:
    """Tokenise a chat through the tokenizer's template; train on every assistant turn (content + end token).

    Raises ``TemplateError`` when the template rewrites earlier turns so that one row cannot train every
    turn on its own view; ``tokenize_chat_rows`` (or ``tokenize_records``) returns the rows then.
    """
    rows = tokenize_chat_rows(record_or_messages, tokenizer, max_length, truncation_side)
    if len(rows) > 1:
        raise TemplateError(
            f"{rows[0].id.rsplit('/', 1)[0]}: the chat template renders earlier assistant turns differently once "
            f"later turns follow (e.g. it strips their reasoning), so this chat needs {len(rows)} training rows, "
            f"one per view ({', '.join(row.id for row in rows)}); use tokenize_chat_rows or tokenize_records."
        )
    return rows[0]


def tokenize_prompt_completion(
    prompt_messages: Sequence[Message | dict[str, Any]],
    completion_messages: Sequence[Message | dict[str, Any]],
    tokenizer,
    max_length: int,
    truncation_side: TruncationSide = "left",
    example_id: str | None = None,
    tier: int | None = None,
    difficulty: float | None = None,
) -> TokenizedExample:
    """Tokenise ``prompt + completion``; labels only on the completion's assistant turns.

    Untruncated, the ids before the first trained token are ``posttrain.data.chat.encode_prompt(tokenizer, prompt)``:
    the ids generation samples the completion from. Truncation keeps the completion and cuts the prompt
    first (see the module docstring).
    """
    _check_side(truncation_side)
    prompt, completion = as_message_dicts(prompt_messages), as_message_dicts(completion_messages)
    if example_id is None:
        example_id = stable_id([prompt, completion], "pc-")
    trained = [len(prompt) + i for i, m in enumerate(completion) if m["role"] == "assistant"]
    facts = chat_facts(tokenizer)
    [rows] = _plan_rows(tokenizer, [_Conversation(prompt + completion, trained, example_id)], facts)
    if len(rows) > 1:
        raise TemplateError(
            f"{example_id}: the chat template renders the completion's earlier assistant turns differently once "
            "later turns follow, so one sequence cannot train each on its own view; give a completion with "
            "one assistant turn."
        )
    [(ids, labels)] = _encode_rows(tokenizer, rows, facts)
    truncated = len(ids) > max_length
    if truncated:
        first_target = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(ids))
        prompt_len = first_target
        completion_len = len(ids) - prompt_len
        if completion_len >= max_length:
            ids, labels = ids[prompt_len : prompt_len + max_length], labels[prompt_len : prompt_len + max_length]
        else:
            keep = max_length - completion_len
            kept = range(prompt_len - keep, prompt_len) if truncation_side == "left" else range(keep)
            order = [*kept, *range(prompt_len, len(ids))]
            ids, labels = [ids[i] for i in order], [labels[i] for i in order]
    return TokenizedExample(ids, labels, truncated, example_id, tier, difficulty)


def tokenize_preference(
    pair: PreferencePair, tokenizer, max_length: int, truncation_side: TruncationSide = "left"
) -> tuple[TokenizedExample, TokenizedExample]:
    """``(chosen, rejected)`` tokenised against the same prompt; ids are ``<pair id>/chosen|rejected``."""
    return tuple(  # type: ignore[return-value]
        tokenize_prompt_completion(
            pair.prompt, side, tokenizer, max_length, truncation_side,
            example_id=f"{pair.id}/{name}", tier=pair.tier, difficulty=pair.difficulty,
        )
        for name, side in (("chosen", pair.chosen), ("rejected", pair.rejected))
    )


def tokenize_records(
    records: Iterable[SFTExample],
    tokenizer,
    max_length: int,
    truncation_side: TruncationSide = "right",
    progress: bool = True,
    batch_size: int = 256,
) -> tuple[list[TokenizedExample], TokenizeReport]:
    """Tokenise SFT records (the same rows as ``tokenize_chat_rows`` on each, in record order) with a
    progress bar, rendering and encoding ``batch_size`` conversations per call; the report counts truncation and
    rows (nothing is dropped)."""
    _check_side(truncation_side)
    report = TokenizeReport(max_length=max_length, truncation_side=truncation_side)
    examples: list[TokenizedExample] = []
    records = list(records)
    facts = chat_facts(tokenizer)
    bar = progress_bar(total=len(records), desc="tokenising", unit="ex", disable=not progress)
    for start in range(0, len(records), batch_size):
        conversations = [_as_chat(record) for record in records[start : start + batch_size]]
        for rows in _tokenize_chats(tokenizer, conversations, max_length, truncation_side, facts):
            report.records += 1
            for example, length in rows:
                report.lengths.append(length)
                if example.truncated:
                    report.truncated += 1
                    report.tokens_dropped += length - max_length
                report.examples += 1
                report.tokens += len(example)
                targets = example.num_targets
                report.target_tokens += targets
                report.no_targets += targets == 0
                examples.append(example)
        bar.update(len(conversations))
    bar.close()
    return examples, report
