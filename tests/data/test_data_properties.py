"""Property-based tests (hypothesis) for assistant loss masks on random conversations and for packing."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import processors
from transformers.masking_utils import find_packed_sequence_indices

from posttrain.data.chat import encode_prompt
from posttrain.data.packing import collate_packed, pack_examples
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedExample, tokenize_chat, tokenize_prompt_completion

# NFC-stable characters (the tiny tokenizer normalises to NFC), whitespace runs, and multi-byte text.
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 .,!?'-:;()\n\téü中文🙂"
EOT = "<|eot|>"
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Leading/trailing whitespace runs are where BPE merges template text into content tokens: make them common.
_core = st.text(alphabet=ALPHABET, min_size=1, max_size=40).filter(lambda s: s.strip())
_space = st.text(alphabet=" \n\t", max_size=3)
texts = st.tuples(_space, _core, _space).map("".join)


@st.composite
def conversations(draw) -> list[dict[str, str]]:
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(st.text(alphabet=ALPHABET, max_size=20))})
    for _ in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": draw(texts)})
        for _ in range(draw(st.integers(1, 2))):  # sometimes two assistant turns in a row
            messages.append({"role": "assistant", "content": draw(texts)})
    if draw(st.booleans()):
        messages.append({"role": "user", "content": draw(texts)})  # a trailing user turn trains nothing
    return messages


def labelled_runs(example: TokenizedExample) -> list[list[int]]:
    runs, current = [], []
    for token, label in zip(example.input_ids, example.labels, strict=True):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


# The tiny model's ChatML-like template; one whose generation prompt ends in a space, which BPE would merge
# into the first content token (" The" after "assistant:") if the turn were not encoded from where the
# prompt ends; and the ChatML-like one without "{{ bos_token }}" on a tokenizer that adds BOS itself.
TEMPLATES = {
    "chatml": (None, False),
    "colon": ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot|>\n{% endfor %}"
              "{% if add_generation_prompt %}assistant: {% endif %}", False),
    "implicit-bos": ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|eot|>\n' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}", True),
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def chat_tokenizer(request, tiny_tokenizer):
    """``(tokenizer, text the tokenizer puts in front of the rendering)``."""
    template, implicit_bos = TEMPLATES[request.param]
    tokenizer = copy.deepcopy(tiny_tokenizer)
    if template is not None:
        tokenizer.chat_template = template
    if implicit_bos:
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
    return tokenizer, tokenizer.bos_token if implicit_bos else ""


@SETTINGS
@given(messages=conversations())
def test_mask_is_exactly_the_assistant_turns(chat_tokenizer, messages):
    tokenizer, implicit = chat_tokenizer
    example = tokenize_chat(messages, tokenizer, max_length=10**6)
    assert all(label in (IGNORE_INDEX, token) for token, label in zip(example.input_ids, example.labels, strict=True))
    assert tokenizer.decode(example.input_ids) == implicit + tokenizer.apply_chat_template(messages, tokenize=False)
    # Exactly content + end token: the turn is encoded from where its prompt ends, so no template text
    # (the colon template's trailing space) is merged into its first token.
    runs = [tokenizer.decode(run) for run in labelled_runs(example)]
    assert runs == [m["content"] + EOT for m in messages if m["role"] == "assistant"]


@SETTINGS
@given(messages=conversations())
def test_prompt_ids_are_the_ids_generation_samples_from(chat_tokenizer, messages):
    tokenizer, _ = chat_tokenizer
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    example = tokenize_prompt_completion(messages[:last], [messages[last]], tokenizer, 10**6)
    first = next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)
    assert example.input_ids[:first] == encode_prompt(tokenizer, messages[:last])


@SETTINGS
@given(messages=conversations(), max_length=st.integers(1, 80), side=st.sampled_from(["left", "right"]))
def test_truncation_is_a_slice_of_the_full_example(tiny_tokenizer, messages, max_length, side):
    full = tokenize_chat(messages, tiny_tokenizer, max_length=10**6)
    cut = tokenize_chat(messages, tiny_tokenizer, max_length=max_length, truncation_side=side)
    assert cut.truncated == (len(full) > max_length)
    assert len(cut) == min(len(full), max_length)
    keep = slice(0, max_length) if side == "right" else slice(max(0, len(full) - max_length), None)
    assert (cut.input_ids, cut.labels) == (full.input_ids[keep], full.labels[keep])


@SETTINGS
@given(messages=conversations(), max_length=st.integers(1, 120))
def test_prompt_completion_keeps_the_completion_end(tiny_tokenizer, messages, max_length):
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt, completion = messages[:last_assistant], messages[last_assistant : last_assistant + 1]
    full = tokenize_prompt_completion(prompt, completion, tiny_tokenizer, 10**6)
    cut = tokenize_prompt_completion(prompt, completion, tiny_tokenizer, max_length)
    assert len(cut) == min(len(full), max_length)
    assert len(labelled_runs(full)) == 1
    first = next(i for i, label in enumerate(full.labels) if label != IGNORE_INDEX)
    completion_ids = full.input_ids[first:]
    if len(completion_ids) <= max_length:  # the whole completion survives; the prompt is cut from the left
        assert cut.input_ids == full.input_ids[first - (len(cut) - len(completion_ids)) :]
    else:  # only the completion's start survives
        assert cut.input_ids == completion_ids[:max_length]


# ------------------------------------------------------------------------------------------ packing


@st.composite
def examples_and_length(draw) -> tuple[list[TokenizedExample], int]:
    max_length = draw(st.integers(1, 64))
    count = draw(st.integers(0, 25))
    examples = []
    for index in range(count):
        length = draw(st.integers(1, max_length))
        ids = draw(st.lists(st.integers(1, 500), min_size=length, max_size=length))
        mask = draw(st.lists(st.booleans(), min_size=length, max_size=length))
        labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask, strict=True)]
        examples.append(TokenizedExample(ids, labels, False, f"ex{index}"))
    return examples, max_length


@settings(max_examples=200, deadline=None)
@given(data=examples_and_length())
def test_packing_keeps_every_token_once_in_order(data):
    examples, max_length = data
    by_id = {e.id: e for e in examples}
    rows = pack_examples(examples, max_length, pad_token_id=0)
    assert all(len(r.input_ids) == len(r.labels) == len(r.position_ids) == max_length for r in rows)
    assert [i for r in rows for i in r.example_ids] == [e.id for e in examples]

    used = []  # tokens of real examples in each row
    for row in rows:
        position = 0
        for start, example_id in zip(row.starts, row.example_ids, strict=True):
            example = by_id[example_id]
            end = start + len(example.input_ids)
            assert start == position  # no gaps inside a row
            assert row.input_ids[start:end] == example.input_ids
            assert row.position_ids[start:end] == list(range(len(example.input_ids)))
            # an example's first token is never a target: unpacked, nothing precedes it
            assert row.labels[start:end] == [IGNORE_INDEX] + example.labels[1:]
            position = end
        padding = max_length - position
        assert row.labels[position:] == [IGNORE_INDEX] * padding
        assert row.input_ids[position:] == [0] * padding
        assert row.position_ids[position:] == list(range(padding))
        used.append(position)

    # Greedy: a row is closed only when the next example would not fit in it.
    for row_used, following in zip(used, rows[1:], strict=False):
        assert row_used + len(by_id[following.example_ids[0]].input_ids) > max_length

    # transformers must see exactly one segment per example, plus one for the padding.
    if rows:
        segments = find_packed_sequence_indices(collate_packed(rows)["position_ids"])
        for index, (row, row_used) in enumerate(zip(rows, used, strict=True)):
            expected = len(row.example_ids) + (row_used < max_length)
            got = 1 if segments is None else int(segments[index, -1]) + 1
            assert got == expected


@settings(max_examples=50, deadline=None)
@given(data=examples_and_length())
def test_packing_refuses_overlong_examples(data):
    examples, max_length = data
    too_long = TokenizedExample([1] * (max_length + 1), [1] * (max_length + 1), False, "long")
    with pytest.raises(ValueError, match="truncate it first"):
        pack_examples([*examples, too_long], max_length)


def test_collate_packed_has_no_attention_mask():
    rows = pack_examples([TokenizedExample([5, 6], [5, 6], False, "a")], 4)
    batch = collate_packed(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                          "max_length_k", "gather_index", "targets", "sequence_index"}
    assert torch.equal(batch["position_ids"], torch.tensor([[0, 1, 0, 1]]))
    # the example, then the padding segment (its positions restart at 0)
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 4] and batch["max_length_q"] == 2
