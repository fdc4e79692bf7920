"""Format detection and conversion: every supported format, the common fields, and field-naming errors."""

from __future__ import annotations

import pytest

from posttrain.data.formats import (
    EMPTY_MESSAGE,
    EMPTY_PROMPT,
    FORMATS,
    IDENTICAL_PAIR,
    MISSING_FIELD,
    WRONG_KIND,
    WRONG_TYPE,
    FormatError,
    detect_format,
    record_to_raw,
    to_record,
)
from posttrain.data.records import Message, PreferencePair, RLPrompt, SFTExample

USER_Q, ANSWER = "What is 2 plus 3?", "5"

EXAMPLES = {
    "messages": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER_Q},
                              {"role": "assistant", "content": ANSWER}]},
    "sharegpt": {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": USER_Q},
                                   {"from": "gpt", "value": ANSWER}]},
    "alpaca": {"instruction": USER_Q, "input": "", "output": ANSWER, "system": "Be brief."},
    "preference": {"prompt": USER_Q, "chosen": ANSWER, "rejected": "6", "rationale": "5 is the sum"},
    "preference_conversational": {
        "prompt": [{"role": "user", "content": USER_Q}],
        "chosen": [{"role": "assistant", "content": ANSWER}],
        "rejected": [{"role": "assistant", "content": "6"}],
        "chosen_score": 9, "rejected_score": 2.5,
    },
    "rl": {"prompt": USER_Q, "answer": 5, "verifier": "exact"},
}


def test_every_format_has_an_example():
    assert set(EXAMPLES) == set(FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_detect_format(fmt):
    assert detect_format(EXAMPLES[fmt]) == fmt


@pytest.mark.parametrize("fmt", ["messages", "sharegpt", "alpaca"])
def test_sft_formats_convert_to_the_same_chat(fmt):
    record = to_record(EXAMPLES[fmt], "auto")
    assert isinstance(record, SFTExample)
    assert [(m.role, m.content) for m in record.messages] == [
        ("system", "Be brief."), ("user", USER_Q), ("assistant", ANSWER)]


def test_alpaca_input_follows_the_instruction():
    record = to_record({"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}, "alpaca")
    assert record.messages[0] == Message(role="user", content="Add the numbers.\n\n2 and 3")


def test_standard_preference():
    pair = to_record(EXAMPLES["preference"], "auto")
    assert isinstance(pair, PreferencePair)
    assert pair.prompt == [Message(role="user", content=USER_Q)]
    assert pair.chosen == [Message(role="assistant", content=ANSWER)]
    assert pair.rejected == [Message(role="assistant", content="6")]
    assert pair.rationale == "5 is the sum"


def test_conversational_preference_keeps_scores():
    pair = to_record(EXAMPLES["preference_conversational"], "auto")
    assert (pair.chosen_score, pair.rejected_score) == (9.0, 2.5)


def test_ultrafeedback_score_names_are_accepted():
    raw = dict(EXAMPLES["preference"], score_chosen=8, score_rejected=3)
    pair = to_record(raw, "preference")
    assert (pair.chosen_score, pair.rejected_score) == (8.0, 3.0)
    with pytest.raises(FormatError) as info:
        to_record(dict(raw, chosen_score=1), "preference")
    assert info.value.field == "score_chosen"


def test_implicit_prompt_is_the_shared_prefix():
    shared = [{"role": "user", "content": USER_Q}]
    raw = {"chosen": shared + [{"role": "assistant", "content": "5"}],
           "rejected": shared + [{"role": "assistant", "content": "6"}]}
    pair = to_record(raw, "auto")
    assert pair.prompt == [Message(role="user", content=USER_Q)]
    assert [m.content for m in pair.chosen] == ["5"] and [m.content for m in pair.rejected] == ["6"]


def test_rl_prompt_numeric_answer_becomes_text():
    record = to_record(EXAMPLES["rl"], "auto")
    assert isinstance(record, RLPrompt)
    assert record.answer == "5" and record.verifier == "exact"
    assert record.prompt == [Message(role="user", content=USER_Q)]


def test_rl_prompt_as_messages():
    record = to_record({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                        "tests": "assert f() == 1", "group": "code"}, "rl")
    assert [m.role for m in record.prompt] == ["system", "user"] and record.tests == "assert f() == 1"


def test_common_fields_are_kept_and_unknown_keys_go_to_meta():
    raw = dict(EXAMPLES["messages"], id=17, tier=2, difficulty=0.5, meta={"a": 1}, source="web")
    record = to_record(raw, "auto")
    assert (record.id, record.tier, record.difficulty) == ("17", 2, 0.5)
    assert record.meta == {"a": 1, "source": "web"}


def test_meta_as_json_text_is_decoded():
    record = to_record(dict(EXAMPLES["messages"], meta='{"a": [1, 2]}'), "messages")
    assert record.meta == {"a": [1, 2]}


def test_null_values_count_as_absent():
    record = to_record(dict(EXAMPLES["rl"], tests=None, tier=None, chosen=None), "auto")
    assert record.tests is None and record.tier is None


def test_openai_text_content_parts_are_joined():
    raw = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                        {"role": "assistant", "content": "Hello"}]}
    assert to_record(raw, "messages").messages[0].content == "Hi there"


def test_ids_are_stable_and_content_based():
    first, second = to_record(EXAMPLES["messages"], "auto"), to_record(dict(EXAMPLES["messages"]), "auto")
    other = to_record({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "auto")
    assert first.id == second.id != other.id


@pytest.mark.parametrize("fmt", FORMATS)
def test_written_records_convert_back_unchanged(fmt):
    record = to_record(dict(EXAMPLES[fmt], tier=3, meta={"k": "v"}), fmt)
    raw = record_to_raw(record)
    assert to_record(raw, "auto") == record


@pytest.mark.parametrize(
    ("raw", "fmt", "field", "category"),
    [
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]}, "auto",
         "messages[1].content", MISSING_FIELD),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]}, "auto",
         "messages[1].content", WRONG_TYPE),
        ({"messages": "hello"}, "auto", "messages", WRONG_TYPE),
        ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "a"}]}, "auto",
         "messages[0].content", EMPTY_MESSAGE),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}, "auto",
         "conversations[1].value", EMPTY_MESSAGE),
        ({"conversations": [{"from": "alien", "value": "q"}]}, "auto", "conversations[0].from", "invalid value"),
        ({"instruction": "", "output": "a"}, "auto", "instruction", EMPTY_PROMPT),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "auto", "prompt", EMPTY_PROMPT),
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, "auto", "rejected", IDENTICAL_PAIR),
        ({"prompt": "q", "chosen": "a"}, "preference", "rejected", MISSING_FIELD),
        ({"prompt": [], "answer": "1"}, "auto", "prompt", EMPTY_PROMPT),
        ({"messages": [{"role": "user", "content": "q"}]}, "auto", "messages", "no assistant turn"),
        (dict(EXAMPLES["messages"], tier="2"), "auto", "tier", WRONG_TYPE),
        (dict(EXAMPLES["messages"], tier=4), "auto", "tier", "invalid value"),
        (dict(EXAMPLES["messages"], kind="rl"), "auto", "kind", WRONG_KIND),
        (dict(EXAMPLES["preference"], chosen_score="high"), "auto", "chosen_score", WRONG_TYPE),
    ],
)
def test_conversion_errors_name_the_field(raw, fmt, field, category):
    with pytest.raises(FormatError) as info:
        to_record(raw, fmt)
    assert info.value.field == field
    assert info.value.category == category
    assert field in str(info.value)


def test_unknown_format_names_the_keys_seen():
    with pytest.raises(ValueError, match=r"keys \(question, response\)"):
        detect_format({"question": "q", "response": "r"})


def test_prompt_completion_is_refused_not_misread_as_rl():
    with pytest.raises(FormatError, match="prompt-completion"):
        detect_format({"prompt": "q", "completion": "a"})


def test_forced_format_overrides_detection():
    # Forcing "rl" on a record with chosen/rejected treats those as unknown keys kept in meta.
    record = to_record({"prompt": "q", "chosen": "a", "rejected": "b"}, "rl")
    assert isinstance(record, RLPrompt) and record.meta == {"chosen": "a", "rejected": "b"}
