"""Chat rendering and encoding: the one place that turns a conversation into text and token ids, for
training (``posttrain.data.tokenize``) and for generation (``posttrain.generate``) alike.

The contract training and sampling rely on: the ids a prompt is sampled from, ``encode_prompt(tokenizer, prompt)``
(the rendered prompt encoded whole, implicit BOS added once), are exactly the ids training puts before
the first trained token of ``prompt + completion``: training encodes with ``encode_at_cuts``, cut where
each assistant turn starts, so its first piece is the same prompt text encoded alone (for tokenizers
that cannot encode pieces apart, it checks that the whole encoding starts with those ids).

**Template facts** (``chat_facts``) are found once per tokenizer by rendering a probe conversation
``[user, assistant, user, assistant]`` with sentinel contents, not from a list of known tokens:

- ``end_of_turn``: what the template writes right after an assistant message that it also writes after
  the *last* one (``<|im_end|>``, ``<|eot_id|>``, ``<|end|>``, ``</s>``, ``<end_of_turn>``, ``" </s>"`` for
  Llama-2). Found as the longest run of whole tokens common to the text after the first assistant turn
  (which goes on into the next user turn) and the text after the last one, without its trailing
  whitespace (the newline between turns is the template's, not the model's).
- ``tail``: what the template appends after the last message only, when no generation prompt is asked
  (Phi-3 appends its EOS): the rest of the text after the last assistant turn, past that common run.
- ``implicit_prefix``: the tokens the tokenizer puts in front of plain text itself (usually ``[bos]``);
  prepended to a rendering that does not already start with them, never doubled.
- ``pieces_encode_alone``: whether encoding a text in pieces gives the pieces the tokens they get in
  context (byte-level BPE: yes; SentencePiece-style tokenizers that prepend a word-boundary marker to
  every call: no), which decides how ``encode_at_cuts`` keeps the prompt's ids intact.
- ``end_of_turn_ids``: the end-of-turn token's id when it is one special token, so generation can stop
  there even when it is not the tokenizer's EOS.

Facts are memoised per tokenizer object and re-derived when its template, special tokens or
normalisation pipeline change (a cheap fingerprint is checked on every call), so one tokenizer is
probed once, not once per example.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.data.records import Message

Prompt = str | Sequence[Message] | Sequence[dict[str, Any]]

__all__ = [
    "ChatFacts",
    "Prompt",
    "Segment",
    "TemplateError",
    "as_message_dicts",
    "chat_facts",
    "encode_at_cuts",
    "encode_ids",
    "encode_prompt",
    "encode_texts",
    "render_chats",
    "render_prompt",
    "with_implicit_prefix",
]

# Sentinel contents for the probe conversation: plain letters, so no template trims or escapes them.
_PROBE = ("probeuserqx", "probeassistantqx", "probeuserzx", "probeassistantzx")


class TemplateError(ValueError):
    """The chat template (or tokenizer) cannot give a correct assistant mask for this conversation."""


@dataclass(frozen=True)
class ChatFacts:
    """What posttrain knows about a tokenizer's chat template (see the module docstring)."""

    end_of_turn: str | None  # None: the probe conversation could not be rendered
    tail: str
    implicit_prefix: tuple[int, ...]
    pieces_encode_alone: bool
    end_of_turn_ids: tuple[int, ...]


# ------------------------------------------------------------------------------------- rendering


def as_message_dicts(messages: Sequence[Message | dict[str, Any]]) -> list[dict[str, Any]]:
    """``[{"role", "content", ...}]`` from ``Message`` objects or dicts (dicts are copied, extra keys kept)."""
    out = []
    for message in messages:
        if isinstance(message, Message):
            out.append({"role": message.role, "content": message.content})
        elif isinstance(message, dict) and "role" in message and "content" in message:
            out.append(dict(message))
        else:
            raise TypeError(f"expected a Message or a {{'role', 'content'}} dict, got {message!r}")
    return out


def render_chats(tokenizer, conversations: list[list[dict[str, Any]]], add_generation_prompt: bool,
                 names: Sequence[str] | None = None) -> list[str]:
    """Render many conversations through the tokenizer's template in one ``apply_chat_template`` call.

    When the template raises (many refuse e.g. non-alternating roles), the conversations are rendered one
    by one to name the one that failed (``names[i]`` when given) in a ``TemplateError``.
    """
    if not conversations:
        return []
    try:
        texts = tokenizer.apply_chat_template(conversations, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    except Exception:  # noqa: BLE001 - re-raised below with the conversation that caused it
        texts = []
        for index, conversation in enumerate(conversations):
            try:
                texts.append(tokenizer.apply_chat_template(conversation, tokenize=False,
                                                           add_generation_prompt=add_generation_prompt))
            except Exception as exc:  # noqa: BLE001
                name = names[index] if names is not None else f"conversation {index}"
                raise TemplateError(f"the chat template failed to render {name}: {exc}") from exc
    if not all(isinstance(text, str) for text in texts):
        raise TemplateError("apply_chat_template(tokenize=False) did not return text")
    return list(texts)


def render_prompt(tokenizer, prompt: Prompt) -> str:
    """The text a model continues from: a chat gets the template with the assistant turn opened
    (``add_generation_prompt=True``); a string is used as it is."""
    if isinstance(prompt, str):
        return prompt
    return render_chats(tokenizer, [as_message_dicts(prompt)], add_generation_prompt=True)[0]


# ------------------------------------------------------------------------------------- encoding


def encode_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (any tokenizer, fast or not)."""
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)
    return [list(ids) for ids in encoded["input_ids"]]


def encode_texts(tokenizer, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """``(ids, character offsets)`` for each text, without special tokens, in one batched call."""
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError(f"{type(tokenizer).__name__} is not a fast tokenizer; loss masks need offset mappings")
    if not texts:
        return []
    # Without the attention mask and type ids the call is about 3x faster; they are not used here.
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True,
                        return_attention_mask=False, return_token_type_ids=False)
    return [(list(ids), list(offsets))
            for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)]


def with_implicit_prefix(ids: list[int], prefix: Sequence[int]) -> list[int]:
    """``prefix + ids`` unless ``ids`` already start with it (the template rendered the BOS itself)."""
    if prefix and ids[: len(prefix)] != list(prefix):
        return [*prefix, *ids]
    return ids


Segment = tuple[int, list[int], list[tuple[int, int]]]  # (first character, ids, offsets within the segment)


def encode_at_cuts(tokenizer, texts: list[str], cuts: list[list[int]], facts: ChatFacts | None = None
                   ) -> list[list[Segment]]:
    """Encode each text so that a token boundary falls at each of its ``cuts`` (character offsets, in
    increasing order) and the ids before the first cut are the ids of ``text[:cut]`` encoded alone.

    ``cuts`` are where assistant turns start, so the ids before a turn are the ids its prompt is sampled
    from and the turn's own tokens are the ones a model writes after that prompt. Where pieces encode
    alone as they do in context (byte-level BPE), each text is encoded in pieces, one segment each.
    Otherwise (a SentencePiece-style tokenizer would add a word-boundary marker to every piece) it is
    encoded whole, as one segment, and checked: a token that straddles a cut, or prompt ids that differ
    from the prompt encoded alone, raise ``TemplateError``. Ids exclude the implicit prefix; a text's ids
    are its segments' ids in order.
    """
    facts = facts or chat_facts(tokenizer)
    if facts.pieces_encode_alone:
        starts = [[0, *text_cuts] for text_cuts in cuts]
        pieces = [text[start:end] for text, bounds in zip(texts, starts, strict=True)
                  for start, end in zip(bounds, [*bounds[1:], len(text)], strict=True)]
        encoded = iter(encode_texts(tokenizer, pieces))
        return [[(start, *next(encoded)) for start in bounds] for bounds in starts]
    whole = encode_texts(tokenizer, texts)
    firsts = [index for index, text_cuts in enumerate(cuts) if text_cuts]
    alone = encode_texts(tokenizer, [texts[index][: cuts[index][0]] for index in firsts])
    prompt_ids = dict(zip(firsts, (ids for ids, _ in alone), strict=True))
    for index, ((ids, offsets), text_cuts) in enumerate(zip(whole, cuts, strict=True)):
        for number, cut in enumerate(text_cuts):
            before = sum(1 for _, end in offsets if end <= cut)
            straddles = any(start < cut < end for start, end in offsets)
            if straddles or (number == 0 and ids[:before] != prompt_ids[index]):
                raise TemplateError(
                    f"the tokenizer merges text across the start of an assistant turn (character {cut}: "
                    f"{texts[index][max(0, cut - 20) : cut]!r} | {texts[index][cut : cut + 20]!r}), so the ids "
                    "training would see differ from the ids generation samples from, and this tokenizer "
                    "cannot encode the turn on its own (it prefixes every separately encoded piece). Use a "
                    "template whose generation prompt ends in a special token or a newline."
                )
    return [[(0, ids, offsets)] for ids, offsets in whole]


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """The ids a model is given to continue ``prompt`` (see ``render_prompt``), with the tokenizer's
    implicit prefix (BOS) added once. Training uses the same ids before a completion's first token."""
    # No cut inside a prompt, so both ways of ``encode_at_cuts`` give the text encoded whole.
    [ids] = encode_ids(tokenizer, [render_prompt(tokenizer, prompt)])
    return with_implicit_prefix(ids, chat_facts(tokenizer).implicit_prefix)


# ------------------------------------------------------------------------------------- template facts


def _implicit_prefix(tokenizer) -> tuple[int, ...]:
    """Tokens the tokenizer puts in front of plain text on its own (usually ``[bos]``, often nothing)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    start = with_special.index(plain[0]) if plain and plain[0] in with_special else 0
    if with_special[start : start + len(plain)] == plain:
        return tuple(with_special[:start])
    return ()


def _pieces_encode_alone(tokenizer) -> bool:
    """Whether ``"x\\n"`` and ``"y"`` encoded apart give the ids of ``"x\\ny"`` (no per-call prefix marker)."""
    left, right, joined = encode_ids(tokenizer, ["x\n", "y", "x\ny"])
    return left + right == joined


def _common_token_run(tokenizer, first: str, second: str) -> str:
    """The longest prefix of ``first`` made of whole tokens that ``second`` also starts with."""
    (ids_a, offsets_a), (ids_b, _) = encode_texts(tokenizer, [first, second])
    count = 0
    while count < min(len(ids_a), len(ids_b)) and ids_a[count] == ids_b[count]:
        count += 1
    return first[: offsets_a[count - 1][1]] if count else ""


def _probe_turn_end(tokenizer) -> tuple[str | None, str]:
    """``(end_of_turn, tail)`` from rendering the probe conversation; ``(None, "")`` if it cannot be."""
    if not getattr(tokenizer, "is_fast", False):  # the common token run needs offsets
        return None, ""
    user_1, assistant_1, user_2, assistant_2 = _PROBE
    probe = [{"role": "user", "content": user_1}, {"role": "assistant", "content": assistant_1},
             {"role": "user", "content": user_2}, {"role": "assistant", "content": assistant_2}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe falls back to the EOS rule
        return None, ""
    first, next_user, last = text.find(assistant_1), text.find(user_2), text.rfind(assistant_2)
    if not 0 <= first < next_user < last:  # the template dropped or reordered the probe's contents
        return None, ""
    first_end, after_last = first + len(assistant_1), text[last + len(assistant_2):]
    common = _common_token_run(tokenizer, text[first_end:next_user], after_last)
    return common.rstrip(), after_last[len(common):]


def _end_of_turn_ids(tokenizer, end_of_turn: str | None) -> tuple[int, ...]:
    if not end_of_turn or not end_of_turn.strip():
        return ()
    [ids] = encode_ids(tokenizer, [end_of_turn.strip()])
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return tuple(ids) if len(ids) == 1 and ids[0] in special else ()


def _fingerprint(tokenizer) -> tuple:
    """What the facts depend on; cheap (a few microseconds), so it is checked on every call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pipeline = tuple(
        part.__getstate__() if part is not None else None
        for part in (getattr(backend, name, None) for name in ("normalizer", "pre_tokenizer", "post_processor"))
    ) if backend is not None else ()
    return (repr(tokenizer.chat_template), repr(tokenizer.special_tokens_map), len(tokenizer), pipeline)


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chat_facts(tokenizer) -> ChatFacts:
    """The template facts of ``tokenizer`` (see the module docstring), memoised per tokenizer object."""
    key = _fingerprint(tokenizer)
    cached = _FACTS.get(tokenizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    end_of_turn, tail = _probe_turn_end(tokenizer)
    facts = ChatFacts(end_of_turn, tail, _implicit_prefix(tokenizer), _pieces_encode_alone(tokenizer),
                      _end_of_turn_ids(tokenizer, end_of_turn))
    _FACTS[tokenizer] = (key, facts)
    return facts
