"""Assistant masks without ``{% generation %}`` markers, checked against transformers' own marker masks on
templates shaped like eight model families (``tests/data/templates.py``, which states the marker rule).

The reference for a turn is what the markers select for it in the conversation rendered *through* that
turn (``apply_chat_template(messages[:i+1], return_assistant_tokens_mask=True)``): the turn as the model
saw and wrote it. Prefix-consistent templates must give one row whose ids and mask equal the markers'
on the whole chat; Qwen3, which strips past reasoning, must give each turn a row of its own view.
"""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from posttrain.data.chat import chat_facts, encode_prompt
from posttrain.data.records import SFTExample
from posttrain.data.tokenize import (
    IGNORE_INDEX,
    TemplateError,
    tokenize_chat,
    tokenize_chat_rows,
    tokenize_prompt_completion,
    tokenize_records,
)
from tests.data.templates import (
    CHATS,
    CORPUS,
    FAMILIES,
    PHI3,
    QWEN3,
    QWEN25,
    SPECIAL_TOKENS,
    family_tokenizer,
)

NAMES = sorted(FAMILIES)
PREFIX_CONSISTENT = [name for name in NAMES if not FAMILIES[name].rewrites_history]
UNLIMITED = 10**6


@cache
def tokenizers_for(name: str):
    """``(plain, marked)`` tokenizers of a family, built once per test session."""
    return family_tokenizer(FAMILIES[name]), family_tokenizer(FAMILIES[name], marked=True)


def marker_mask(tokenizer, messages) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def runs(ids: list[int], trained: list[bool]) -> list[list[int]]:
    """Contiguous runs of trained tokens, in order."""
    out, current = [], []
    for token, keep in zip(ids, trained, strict=True):
        if keep:
            current.append(token)
        elif current:
            out.append(current)
            current = []
    return out + ([current] if current else [])


def trained(example) -> list[bool]:
    assert all(label in (IGNORE_INDEX, token) for token, label in zip(example.input_ids, example.labels, strict=True))
    return [label != IGNORE_INDEX for label in example.labels]


def assistant_indices(messages) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


@pytest.mark.parametrize("name", NAMES)
def test_end_of_turn_and_tail_are_read_from_the_template(name):
    family, (plain, _) = FAMILIES[name], tokenizers_for(name)
    facts = chat_facts(plain)
    assert (facts.end_of_turn, facts.tail) == (family.end_of_turn, family.tail)
    assert facts.end_of_turn_ids == (plain.convert_tokens_to_ids(family.end_of_turn.strip()),)
    assert facts.implicit_prefix == ((plain.convert_tokens_to_ids(family.bos),) if family.implicit_bos else ())
    assert facts.pieces_encode_alone


def assert_turns_match_markers(name: str, messages: list[dict[str, str]]) -> None:
    """Each assistant turn is trained on exactly the tokens the markers select for it in its own view,
    and every row is one of those views, training nothing the markers leave out there."""
    plain, marked = tokenizers_for(name)
    prefix = list(chat_facts(plain).implicit_prefix)
    rows = tokenize_chat_rows(messages, plain, UNLIMITED)
    views = {i: marker_mask(marked, messages[: i + 1]) for i in assistant_indices(messages)}
    expected = [runs(ids, [bool(m) for m in mask])[-1] for ids, mask in views.values()]
    assert [run for row in rows for run in runs(row.input_ids, trained(row))] == expected
    for row in rows:
        [(ids, mask)] = [view for view in views.values() if prefix + view[0] == row.input_ids]
        assert all(mask[k] for k, keep in enumerate(trained(row)[len(prefix):]) if keep)


@pytest.mark.parametrize("chat_name", sorted(CHATS))
@pytest.mark.parametrize("name", NAMES)
def test_every_turn_is_trained_as_the_markers_select_it_in_its_own_view(name, chat_name):
    assert_turns_match_markers(name, CHATS[chat_name])


# Contents as people write them (inner spaces and newlines, digits, punctuation, non-ASCII), stripped:
# templates that trim content would otherwise differ from the markers only by where whitespace goes.
_content = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 .,!?'-:;()\néü中文🙂", min_size=1,
                   max_size=30).map(str.strip).filter(bool)


@st.composite
def alternating_chats(draw, reasoning: bool) -> list[dict[str, str]]:
    """Optional system message, then 1-3 user/assistant pairs (every family accepts this shape)."""
    messages = [{"role": "system", "content": draw(_content)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        answer = draw(_content)
        if reasoning and draw(st.booleans()):
            answer = f"<think>\n{draw(_content)}\n</think>\n\n{answer}"
        messages += [{"role": "user", "content": draw(_content)}, {"role": "assistant", "content": answer}]
    return messages


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_random_chats_are_trained_as_the_markers_select(name, data):
    assert_turns_match_markers(name, data.draw(alternating_chats(reasoning=FAMILIES[name].rewrites_history)))


@pytest.mark.parametrize("chat_name", sorted(CHATS))
@pytest.mark.parametrize("name", PREFIX_CONSISTENT)
def test_prefix_consistent_template_gives_one_row_equal_to_the_marker_mask(name, chat_name):
    plain, marked = tokenizers_for(name)
    ids, mask = marker_mask(marked, CHATS[chat_name])
    prefix = list(chat_facts(plain).implicit_prefix)
    example = tokenize_chat(CHATS[chat_name], plain, UNLIMITED)
    assert example.input_ids == prefix + ids
    assert trained(example) == [False] * len(prefix) + [bool(m) for m in mask]


@pytest.mark.parametrize("chat_name", sorted(CHATS))
@pytest.mark.parametrize("name", NAMES)
def test_generation_prompt_ids_are_the_ids_before_the_first_trained_token(name, chat_name):
    plain, marked = tokenizers_for(name)
    messages = CHATS[chat_name]
    for index in assistant_indices(messages):
        example = tokenize_prompt_completion(messages[:index], [messages[index]], plain, UNLIMITED)
        first = trained(example).index(True)
        assert example.input_ids[:first] == encode_prompt(plain, messages[:index])
        ids, mask = marker_mask(marked, messages[: index + 1])
        assert runs(example.input_ids, trained(example)) == [runs(ids, [bool(m) for m in mask])[-1]]


def test_template_tail_and_newline_after_the_end_of_turn_token_are_not_trained():
    plain, _ = tokenizers_for(PHI3.name)
    example = tokenize_chat(CHATS["single"], plain, UNLIMITED)
    pieces = [plain.decode([token]) for token in example.input_ids]
    assert pieces[0] == "<s>" and pieces.count("<s>") == 1  # the tokenizer's BOS, added once
    assert pieces[-3:] == ["<|end|>", "\n", "<|endoftext|>"]
    assert [label != IGNORE_INDEX for label in example.labels[-3:]] == [True, False, False]


@pytest.mark.parametrize("name", [name for name in NAMES if FAMILIES[name].default_system])
def test_system_text_the_template_injects_is_context_not_target(name):
    plain, _ = tokenizers_for(name)
    example = tokenize_chat(CHATS["single"], plain, UNLIMITED)
    trained_text = "".join(plain.decode(run) for run in runs(example.input_ids, trained(example)))
    assert FAMILIES[name].default_system in plain.decode(example.input_ids)
    assert trained_text.strip().startswith("The answer is 42.")
    assert FAMILIES[name].default_system not in trained_text


def test_template_that_strips_past_reasoning_trains_each_turn_on_its_own_view():
    plain, _ = tokenizers_for(QWEN3.name)
    record = SFTExample.model_validate({"messages": CHATS["reasoning"], "id": "r1"})
    rows = tokenize_chat_rows(record, plain, UNLIMITED)
    assert [row.id for row in rows] == ["r1/turn1", "r1/turn3"]
    first, second = (["".join(plain.decode(run) for run in runs(row.input_ids, trained(row)))] for row in rows)
    assert first == ["<think>\nAdd the tens, then the ones.\n</think>\n\nThe answer is 42.<|im_end|>"]
    assert second == ["<think>\nCompare the tens digits.\n</think>\n\n71 is larger.<|im_end|>"]
    # in the second row the first turn is history, shown as the template shows it then: without reasoning
    assert "assistant\nThe answer is 42.<|im_end|>" in plain.decode(rows[1].input_ids)
    with pytest.raises(TemplateError, match="tokenize_chat_rows"):
        tokenize_chat(record, plain, UNLIMITED)
    examples, report = tokenize_records([record, SFTExample.model_validate({"messages": CHATS["single"]})],
                                        plain, UNLIMITED, progress=False)
    assert examples[:2] == rows and (report.records, report.examples) == (2, 3)
    assert "3 examples from 2 records (1 extra rows" in report.summary()


def test_completion_whose_turns_render_differently_later_is_refused():
    plain, _ = tokenizers_for(QWEN3.name)
    messages = CHATS["reasoning"]
    with pytest.raises(TemplateError, match="one assistant turn"):
        tokenize_prompt_completion(messages[:1], messages[1:], plain, UNLIMITED)


# ------------------------------------------------------------------ SentencePiece-style tokenizers


@cache
def metaspace_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A BPE tokenizer that, like Llama-2's, marks word starts with "▁" and puts one in front of every text it
    encodes (so ``"y"`` alone is ``"▁y"`` but ``"y"`` after ``"x\n"`` is not); newlines are their own pieces,
    as SentencePiece vocabularies never merge them with letters."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", behavior="isolated"),
                                                       pre_tokenizers.Metaspace(prepend_scheme="first")])
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    alphabet = sorted(set("".join(CORPUS) + "▁") | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:\n"))
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *SPECIAL_TOKENS], show_progress=False,
                                  initial_alphabet=alphabet)
    tokenizer.train_from_iterator(list(CORPUS), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
                                      additional_special_tokens=list(SPECIAL_TOKENS))
    wrapped.chat_template = template
    return wrapped


def test_tokenizer_that_prefixes_every_piece_is_encoded_whole_and_still_matches_the_markers():
    plain = metaspace_tokenizer(QWEN25.plain)
    marked = metaspace_tokenizer(QWEN25.marked)
    assert not chat_facts(plain).pieces_encode_alone
    for messages in CHATS.values():
        ids, mask = marker_mask(marked, messages)
        example = tokenize_chat(messages, plain, UNLIMITED)
        assert example.input_ids == ids and trained(example) == [bool(m) for m in mask]
        last = assistant_indices(messages)[-1]
        completion = tokenize_prompt_completion(messages[:last], [messages[last]], plain, UNLIMITED)
        assert completion.input_ids[: trained(completion).index(True)] == encode_prompt(plain, messages[:last])


def test_prompt_merged_into_the_turn_by_a_prefixing_tokenizer_is_refused():
    # "assistant: The" is encoded "▁assistant:" "▁The": the prompt's last space belongs to the turn's
    # first token, and encoding the turn alone would add another "▁".
    tokenizer = metaspace_tokenizer("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(TemplateError, match="merges text across the start of an assistant turn"):
        tokenize_chat(CHATS["single"], tokenizer, UNLIMITED)
