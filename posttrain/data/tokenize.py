"""Chat-template tokenisation with assistant-only loss masks that do not need ``{% generation %}``.

How the mask is found, for any chat template that renders a conversation as a growing string:

1. Render the whole conversation once as text (``apply_chat_template(tokenize=False)``).
2. For each trained assistant message ``i``, render ``messages[:i]`` with ``add_generation_prompt=True``
   (the text up to where the model starts writing) and ``messages[:i+1]`` (the text after its turn).
   The characters between the two are the assistant's turn: its content plus the template's
   end-of-turn text. The span ends just after the tokenizer's EOS string when the turn contains it,
   otherwise at the turn's text with trailing whitespace removed (so ``<|im_end|>`` is trained, the
   newline the template puts between turns is not).
3. Tokenise the full text once with ``return_offsets_mapping`` and label every token that has at
   least one character inside a span (``labels = input_ids`` there, ``IGNORE_INDEX`` elsewhere). A
   token that straddles the span's start (BPE merged the template's ``" "`` with the first word, as
   in ``"assistant: The"`` → ``" The"``) is trained: dropping it would never train the first word.

The method needs the template to be *prefix-consistent*: each shorter rendering must be a prefix of
the longer ones. Templates that rewrite earlier turns (e.g. dropping past reasoning) are not, and
raise ``TemplateError`` rather than produce a wrong mask. Special tokens are not added a second
time: the rendered text is tokenised with ``add_special_tokens=False``, and the tokenizer's BOS is
prepended only when the tokenizer would add one and the template did not render it.

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

from tqdm import tqdm

from posttrain.data.records import Message, PreferencePair, SFTExample, stable_id
from posttrain.models.logprobs import IGNORE_INDEX

TruncationSide = Literal["left", "right"]

__all__ = [
    "IGNORE_INDEX",
    "TemplateError",
    "TokenizedExample",
    "TokenizeReport",
    "tokenize_chat",
    "tokenize_prompt_completion",
    "tokenize_preference",
    "tokenize_records",
    "render_prompt",
]


class TemplateError(ValueError):
    """The chat template cannot be used to locate assistant turns (not prefix-consistent)."""


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

    examples: int = 0
    truncated: int = 0
    tokens: int = 0
    tokens_dropped: int = 0
    target_tokens: int = 0
    no_targets: int = 0  # examples left with no trained token (e.g. truncation cut every assistant turn)
    max_length: int = 0
    truncation_side: str = "right"
    lengths: list[int] = field(default_factory=list, repr=False)  # untruncated lengths

    def summary(self) -> str:
        text = (f"tokenised {self.examples} examples: {self.tokens} tokens, {self.target_tokens} trained; "
                f"truncated {self.truncated} at max_length {self.max_length} ({self.truncation_side} side, "
                f"{self.tokens_dropped} tokens dropped)")
        if self.no_targets:
            text += f"; {self.no_targets} example(s) have no trained token left"
        return text


# ------------------------------------------------------------------------------------- rendering


def _as_dicts(messages: Sequence[Message | dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if isinstance(message, Message):
            out.append({"role": message.role, "content": message.content})
        elif isinstance(message, dict) and "role" in message and "content" in message:
            out.append(dict(message))
        else:
            raise TypeError(f"expected a Message or a {{'role', 'content'}} dict, got {message!r}")
    return out


def _render(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):
        raise TemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
    return text


def render_prompt(messages: Sequence[Message | dict[str, Any]], tokenizer) -> str:
    """The text a model continues from to answer ``messages`` (the template's generation prompt included)."""
    return _render(tokenizer, _as_dicts(messages), add_generation_prompt=True)


def _turn_end(turn: str, eos_token: str | None) -> int:
    """Where a rendered assistant turn stops being a training target (see the module docstring)."""
    if eos_token and eos_token in turn:
        return turn.index(eos_token) + len(eos_token)
    return len(turn.rstrip())


def _assistant_spans(tokenizer, messages: list[dict[str, Any]], trained: Sequence[int], full: str
                     ) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` in ``full`` of the assistant turns at indices ``trained``."""
    spans = []
    for index in trained:
        before = _render(tokenizer, messages[:index], add_generation_prompt=True)
        after = _render(tokenizer, messages[: index + 1], add_generation_prompt=False)
        if not after.startswith(before) or not full.startswith(after):
            raise TemplateError(
                f"the chat template is not prefix-consistent at message {index}: rendering the conversation "
                "up to a turn is not a prefix of rendering it further, so assistant turns cannot be located "
                "by text. Use a template that renders earlier turns identically (or one without per-turn "
                "rewriting, e.g. of reasoning content)."
            )
        end = len(before) + _turn_end(after[len(before):], getattr(tokenizer, "eos_token", None))
        if end > len(before):
            spans.append((len(before), end))
    return spans


def _implicit_prefix(tokenizer) -> list[int]:
    """Tokens the tokenizer puts in front of plain text on its own (usually ``[bos]``, often nothing).

    Computed per call (or per ``tokenize_records`` batch), never cached globally, so a tokenizer whose
    post-processor changes is never answered from a stale cache.
    """
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    if len(with_special) > len(plain) and with_special[len(with_special) - len(plain):] == plain:
        return list(with_special[: len(with_special) - len(plain)])
    return []


def _encode(tokenizer, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """``(ids, char offsets)`` per text, one batched call (the Rust tokenizer parallelises batches)."""
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError(f"{type(tokenizer).__name__} is not a fast tokenizer; loss masks need offset mappings")
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [(list(ids), offsets) for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)]


def _mask(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]], prefix: list[int]
          ) -> tuple[list[int], list[int]]:
    """Labels for ``ids``: the token id where the token overlaps a span, ``IGNORE_INDEX`` elsewhere."""
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
    if prefix and ids[: len(prefix)] != prefix:
        ids = prefix + ids
        labels = [IGNORE_INDEX] * len(prefix) + labels
    return ids, labels


def _encode_with_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    [(ids, offsets)] = _encode(tokenizer, [text])
    return _mask(ids, offsets, spans, _implicit_prefix(tokenizer))


def _check_side(truncation_side: str) -> None:
    if truncation_side not in ("left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")


# ------------------------------------------------------------------------------------- public API


def _chat_plan(record_or_messages, tokenizer) -> tuple[str, list[tuple[int, int]], str, int | None, float | None]:
    """The rendered chat, its assistant spans, and the record's id/tier/difficulty."""
    if isinstance(record_or_messages, SFTExample):
        record = record_or_messages
        messages, example_id, tier, difficulty = _as_dicts(record.messages), record.id, record.tier, record.difficulty
    else:
        messages = _as_dicts(record_or_messages)
        example_id, tier, difficulty = stable_id(messages, "sft-"), None, None
    full = _render(tokenizer, messages, add_generation_prompt=False)
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return full, _assistant_spans(tokenizer, messages, trained, full), example_id, tier, difficulty


def _truncate_chat(ids: list[int], labels: list[int], max_length: int, side: str) -> tuple[list[int], list[int]]:
    keep = slice(0, max_length) if side == "right" else slice(len(ids) - max_length, None)
    return ids[keep], labels[keep]


def tokenize_chat(
    record_or_messages: SFTExample | Sequence[Message | dict[str, Any]],
    tokenizer,
    max_length: int,
    truncation_side: TruncationSide = "right",
) -> TokenizedExample:
    """Tokenise a chat through the tokenizer's template; train on every assistant turn (content + end token)."""
    _check_side(truncation_side)
    full, spans, example_id, tier, difficulty = _chat_plan(record_or_messages, tokenizer)
    ids, labels = _encode_with_mask(tokenizer, full, spans)
    truncated = len(ids) > max_length
    if truncated:
        ids, labels = _truncate_chat(ids, labels, max_length, truncation_side)
    return TokenizedExample(ids, labels, truncated, example_id, tier, difficulty)


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

    Truncation keeps the completion and cuts the prompt first (see the module docstring).
    """
    _check_side(truncation_side)
    prompt, completion = _as_dicts(prompt_messages), _as_dicts(completion_messages)
    messages = prompt + completion
    full = _render(tokenizer, messages, add_generation_prompt=False)
    trained = [len(prompt) + i for i, m in enumerate(completion) if m["role"] == "assistant"]
    ids, labels = _encode_with_mask(tokenizer, full, _assistant_spans(tokenizer, messages, trained, full))
    if example_id is None:
        example_id = stable_id([prompt, completion], "pc-")
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
    """Tokenise SFT records (same result as ``tokenize_chat`` on each) with a progress bar, encoding
    ``batch_size`` chats per tokenizer call; the report counts truncation (nothing is dropped)."""
    _check_side(truncation_side)
    report = TokenizeReport(max_length=max_length, truncation_side=truncation_side)
    examples: list[TokenizedExample] = []
    records = list(records)
    prefix = _implicit_prefix(tokenizer)
    bar = tqdm(total=len(records), desc="tokenising", unit=" ex", disable=None if progress else True, leave=False)
    for start in range(0, len(records), batch_size):
        plans = [_chat_plan(record, tokenizer) for record in records[start : start + batch_size]]
        encoded = _encode(tokenizer, [plan[0] for plan in plans])
        for (_, spans, example_id, tier, difficulty), (raw_ids, offsets) in zip(plans, encoded, strict=True):
            ids, labels = _mask(raw_ids, offsets, spans, prefix)
            report.lengths.append(len(ids))
            truncated = len(ids) > max_length
            if truncated:
                report.truncated += 1
                report.tokens_dropped += len(ids) - max_length
                ids, labels = _truncate_chat(ids, labels, max_length, truncation_side)
            example = TokenizedExample(ids, labels, truncated, example_id, tier, difficulty)
            report.examples += 1
            report.tokens += len(example)
            targets = example.num_targets
            report.target_tokens += targets
            report.no_targets += targets == 0
            examples.append(example)
        bar.update(len(plans))
    bar.close()
    return examples, report
