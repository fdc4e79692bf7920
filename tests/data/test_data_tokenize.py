"""Chat tokenisation: assistant-only loss masks on multi-turn chats, special tokens, truncation rules."""

from __future__ import annotations

import copy

import pytest
from tokenizers import processors

from posttrain.data.chat import chat_facts, encode_prompt
from posttrain.data.records import Message, PreferencePair, SFTExample
from posttrain.data.samples import sample_sft_records
from posttrain.data.tokenize import (
    IGNORE_INDEX,
    TemplateError,
    tokenize_chat,
    tokenize_preference,
    tokenize_prompt_completion,
    tokenize_records,
)

EOT = "<|eot|>"

CHAT = [
    Message(role="system", content="Be brief."),
    Message(role="user", content="What is 12 plus 30?"),
    Message(role="assistant", content="The answer is 42."),
    Message(role="user", content="Reverse the word hello."),
    Message(role="assistant", content="olleh"),
    Message(role="user", content="Thanks!"),
    Message(role="assistant", content="You are welcome.\nBye."),
]


def labelled_runs(example) -> list[list[int]]:
    """Contiguous runs of trained tokens, in order."""
    runs, current = [], []
    for token, label in zip(example.input_ids, example.labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def test_multi_turn_mask_covers_exactly_each_assistant_turn_and_its_end_token(tiny_tokenizer):
    example = tokenize_chat(CHAT, tiny_tokenizer, max_length=512)
    decoded = [tiny_tokenizer.decode(run) for run in labelled_runs(example)]
    assert decoded == [m.content + EOT for m in CHAT if m.role == "assistant"]
    assert not example.truncated


def test_full_text_matches_the_template_without_doubled_special_tokens(tiny_tokenizer):
    example = tokenize_chat(CHAT, tiny_tokenizer, max_length=512)
    rendered = tiny_tokenizer.apply_chat_template([m.model_dump() for m in CHAT], tokenize=False)
    assert tiny_tokenizer.decode(example.input_ids) == rendered
    assert example.input_ids.count(tiny_tokenizer.bos_token_id) == 1


def test_bos_added_once_when_the_tokenizer_adds_it_and_the_template_does_not(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", pair=f"{tokenizer.bos_token} $A $B",
        special_tokens=[(tokenizer.bos_token, bos)])
    with_bos = tokenize_chat(CHAT, tokenizer, 512)
    assert with_bos.input_ids[0] == bos and with_bos.input_ids.count(bos) == 1  # template renders BOS itself
    tokenizer.chat_template = tokenizer.chat_template.replace("{{ bos_token }}", "")
    prepended = tokenize_chat(CHAT, tokenizer, 512)
    assert prepended.input_ids == with_bos.input_ids and prepended.labels == with_bos.labels


def test_record_tags_are_carried(tiny_tokenizer):
    record = SFTExample(messages=CHAT, tier=3, difficulty=0.7, id="abc")
    example = tokenize_chat(record, tiny_tokenizer, 512)
    assert (example.id, example.tier, example.difficulty) == ("abc", 3, 0.7)


def test_plain_text_end_of_turn_is_found_from_the_template(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} [END]\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    assert chat_facts(tokenizer).end_of_turn == " [END]"
    example = tokenize_chat(CHAT[1:3], tokenizer, 512)
    # The generation prompt ends in a space that BPE would merge into " The". Training encodes the turn
    # from where the prompt ends, as generation samples it: the prompt keeps its " " token, the turn
    # starts with "The", and the "\n\n" between turns is not trained.
    assert [tokenizer.decode(run) for run in labelled_runs(example)] == ["The answer is 42. [END]"]
    prompt_ids = encode_prompt(tokenizer, CHAT[1:2])
    assert example.input_ids[: len(prompt_ids)] == prompt_ids and tokenizer.decode(prompt_ids[-1:]) == " "
    assert example.labels[len(prompt_ids) - 1] == IGNORE_INDEX != example.labels[len(prompt_ids)]


def test_template_whose_prompt_is_not_a_prefix_of_the_turn_is_refused(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(TemplateError, match="not prefix-consistent at message 1"):
        tokenize_chat(CHAT[1:5], tokenizer, 512)


def test_tail_after_the_last_message_is_not_trained(tiny_tokenizer):
    # No end-of-turn text, but an EOS appended after the last message only (Phi-3 style, minus "<|end|>").
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% else %}{{ eos_token }}{% endif %}"
    )
    facts = chat_facts(tokenizer)
    assert (facts.end_of_turn, facts.tail) == ("", EOT)
    example = tokenize_chat(CHAT[1:5], tokenizer, 512)
    assert [tokenizer.decode(run) for run in labelled_runs(example)] == ["The answer is 42.", "olleh"]
    assert tokenizer.decode(example.input_ids[-1:]) == EOT


def test_template_that_refuses_the_probe_chat_ends_turns_after_eos(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}"
        + tokenizer.chat_template
    )
    assert chat_facts(tokenizer).end_of_turn is None
    example = tokenize_chat(CHAT, tokenizer, 512)
    assert [tokenizer.decode(run) for run in labelled_runs(example)] == [m.content + EOT for m in CHAT[2::2]]
    with pytest.raises(TemplateError, match="a system message comes first"):
        tokenize_chat(CHAT[1:], tokenizer, 512)


def test_chat_that_starts_with_an_assistant_turn_is_refused(tiny_tokenizer):
    with pytest.raises(TemplateError, match="message 0 of .* is an assistant turn"):
        tokenize_chat([Message(role="assistant", content="Hello!"), *CHAT[1:3]], tiny_tokenizer, 512)


def test_template_facts_follow_edits_to_the_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    assert (chat_facts(tokenizer).end_of_turn, chat_facts(tokenizer).implicit_prefix) == (EOT, ())
    tokenizer.chat_template = tokenizer.chat_template.replace("<|eot|>", " [END]")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
    facts = chat_facts(tokenizer)
    assert (facts.end_of_turn, facts.implicit_prefix) == (" [END]", (tokenizer.bos_token_id,))
    assert chat_facts(tiny_tokenizer).end_of_turn == EOT  # the original is untouched


@pytest.mark.parametrize("side", ["right", "left"])
def test_chat_truncation_side(tiny_tokenizer, side):
    full = tokenize_chat(CHAT, tiny_tokenizer, 512)
    cut = tokenize_chat(CHAT, tiny_tokenizer, 20, truncation_side=side)
    assert cut.truncated and len(cut) == 20
    expected = slice(0, 20) if side == "right" else slice(len(full) - 20, None)
    assert cut.input_ids == full.input_ids[expected] and cut.labels == full.labels[expected]


def test_invalid_truncation_side(tiny_tokenizer):
    with pytest.raises(ValueError, match="truncation_side"):
        tokenize_chat(CHAT, tiny_tokenizer, 20, truncation_side="middle")


def test_tokenize_records_counts_truncation(tiny_tokenizer):
    records = sample_sft_records(18)
    full_lengths = [len(tokenize_chat(r, tiny_tokenizer, 10**6)) for r in records]
    limit = sorted(full_lengths)[len(full_lengths) // 2]
    examples, report = tokenize_records(records, tiny_tokenizer, limit, progress=False, batch_size=5)
    assert examples == [tokenize_chat(r, tiny_tokenizer, limit) for r in records]  # batched == one by one
    over = [n for n in full_lengths if n > limit]
    assert report.examples == len(examples) == 18
    assert report.truncated == len(over) > 0
    assert report.tokens_dropped == sum(n - limit for n in over)
    assert report.tokens == sum(len(e) for e in examples) and report.lengths == full_lengths
    assert [e.truncated for e in examples] == [n > limit for n in full_lengths]
    assert f"truncated {len(over)}" in report.summary()


PROMPT = [Message(role="system", content="Be brief."), Message(role="user", content="Name three fruits, please.")]
COMPLETION = [Message(role="assistant", content="apple, banana, cherry")]


def test_prompt_completion_labels_only_the_completion(tiny_tokenizer):
    example = tokenize_prompt_completion(PROMPT, COMPLETION, tiny_tokenizer, 512)
    assert [tiny_tokenizer.decode(run) for run in labelled_runs(example)] == [COMPLETION[0].content + EOT]


def test_prompt_completion_never_labels_prompt_assistant_turns(tiny_tokenizer):
    prompt = CHAT[:5] + [CHAT[5]]
    example = tokenize_prompt_completion(prompt, [CHAT[6]], tiny_tokenizer, 512)
    assert [tiny_tokenizer.decode(run) for run in labelled_runs(example)] == [CHAT[6].content + EOT]


@pytest.mark.parametrize("side", ["left", "right"])
def test_prompt_is_cut_before_the_completion(tiny_tokenizer, side):
    full = tokenize_prompt_completion(PROMPT, COMPLETION, tiny_tokenizer, 512)
    first_target = next(i for i, label in enumerate(full.labels) if label != IGNORE_INDEX)
    completion_len = len(full) - first_target
    max_length = completion_len + 3
    cut = tokenize_prompt_completion(PROMPT, COMPLETION, tiny_tokenizer, max_length, truncation_side=side)
    assert cut.truncated and len(cut) == max_length
    assert cut.input_ids[3:] == full.input_ids[first_target:]  # completion kept whole
    kept_prompt = full.input_ids[first_target - 3 : first_target] if side == "left" else full.input_ids[:3]
    assert cut.input_ids[:3] == kept_prompt
    assert labelled_runs(cut) == labelled_runs(full)


def test_overlong_completion_drops_the_prompt_and_keeps_its_start(tiny_tokenizer):
    full = tokenize_prompt_completion(PROMPT, COMPLETION, tiny_tokenizer, 512)
    first_target = next(i for i, label in enumerate(full.labels) if label != IGNORE_INDEX)
    cut = tokenize_prompt_completion(PROMPT, COMPLETION, tiny_tokenizer, 4)
    assert cut.input_ids == full.input_ids[first_target : first_target + 4]
    assert all(label != IGNORE_INDEX for label in cut.labels)


def test_preference_pair_shares_the_prompt(tiny_tokenizer):
    pair = PreferencePair(prompt=PROMPT, chosen=COMPLETION, rejected=[Message(role="assistant", content="chair")],
                          tier=2, id="p1")
    chosen, rejected = tokenize_preference(pair, tiny_tokenizer, 512)
    assert (chosen.id, rejected.id, chosen.tier) == ("p1/chosen", "p1/rejected", 2)
    first_c = next(i for i, label in enumerate(chosen.labels) if label != IGNORE_INDEX)
    first_r = next(i for i, label in enumerate(rejected.labels) if label != IGNORE_INDEX)
    assert first_c == first_r and chosen.input_ids[:first_c] == rejected.input_ids[:first_r]
    assert tiny_tokenizer.decode(labelled_runs(rejected)[0]) == "chair" + EOT


def test_a_chat_the_template_refuses_is_named_in_the_error(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (  # roles must alternate, as Mistral's and Llama-2's templates demand
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{% endfor %}" + tokenizer.chat_template
    )
    good = SFTExample(messages=CHAT[1:5], id="good")
    bad = SFTExample(messages=[*CHAT[1:3], Message(role="assistant", content="And more.")], id="bad")
    assert len(tokenize_records([good], tokenizer, 512, progress=False)[0]) == 1
    with pytest.raises(TemplateError, match="failed to render bad .*roles must alternate"):
        tokenize_records([good, bad], tokenizer, 512, progress=False)
