"""Format detection and conversion: every supported format, the common fields, and field-naming errors."""

from __future__ import annotations

import pytest

from posttrain.data.formats import (
    EMPTY_MESSAGE,
    EMPTY_PROMPT,
    EMPTY_RESPONSE,
    FORMAT_KIND,
    FORMATS,
    IDENTICAL_PAIR,
    INVALID_VALUE,
    MISSING_FIELD,
    NO_ASSISTANT,
    WRONG_KIND,
    WRONG_TYPE,
    FormatError,
    convert,
    detect_format,
    record_to_raw,
    to_prompt,
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
    "prompt_completion": {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER_Q}],
                          "completion": ANSWER},
    "hh_rlhf": {"chosen": f"\n\nHuman: {USER_Q}\n\nAssistant: {ANSWER}",
                "rejected": f"\n\nHuman: {USER_Q}\n\nAssistant: 6"},
    "rl": {"prompt": USER_Q, "answer": 5, "verifier": "exact"},
}


def test_every_format_has_an_example():
    assert set(EXAMPLES) == set(FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_detect_format(fmt):
    assert detect_format(EXAMPLES[fmt]) == fmt


@pytest.mark.parametrize("fmt", ["messages", "sharegpt", "alpaca", "prompt_completion"])
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
        ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
          "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]}, "auto",
         "prompt", MISSING_FIELD),
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


def test_forced_format_overrides_detection():
    # Forcing "rl" on a record with chosen/rejected treats those as unknown keys kept in meta.
    record = to_record({"prompt": "q", "chosen": "a", "rejected": "b"}, "rl")
    assert isinstance(record, RLPrompt) and record.meta == {"chosen": "a", "rejected": "b"}


# -- TRL prompt-completion ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"prompt": "q", "completion": "a"}, [("user", "q"), ("assistant", "a")]),
        ({"prompt": "q", "response": "a"}, [("user", "q"), ("assistant", "a")]),
        ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]},
         [("user", "q"), ("assistant", "a")]),
        ({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"},
                                        {"role": "assistant", "content": "b"}]},
         [("user", "q"), ("assistant", "a"), ("user", "more"), ("assistant", "b")]),
    ],
)
def test_prompt_completion_is_an_sft_example(raw, expected):
    record, fmt = convert(raw, kind="sft")
    assert fmt == "prompt_completion" and isinstance(record, SFTExample)
    assert [(m.role, m.content) for m in record.messages] == expected


@pytest.mark.parametrize(
    ("raw", "field", "category"),
    [
        ({"prompt": "q", "completion": "  "}, "completion", EMPTY_RESPONSE),
        ({"prompt": "q", "response": ""}, "response", EMPTY_RESPONSE),
        ({"prompt": "q", "completion": "a", "response": "b"}, "response", INVALID_VALUE),
        ({"prompt": "q", "completion": [{"role": "user", "content": "x"}]}, "completion", NO_ASSISTANT),
        ({"prompt": "", "completion": "a"}, "prompt", EMPTY_PROMPT),
        ({"prompt": "q", "completion": 3}, "completion", WRONG_TYPE),
    ],
)
def test_prompt_completion_errors_name_the_field(raw, field, category):
    with pytest.raises(FormatError) as info:
        to_record(raw, "auto")
    assert (info.value.field, info.value.category) == (field, category)


def test_preference_with_a_conversational_prompt_and_text_responses():
    raw = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": USER_Q}],
           "chosen": ANSWER, "rejected": "6"}
    pair, fmt = convert(raw, kind="preference")
    assert fmt == "preference" and [m.role for m in pair.prompt] == ["system", "user"]
    assert pair.chosen == [Message(role="assistant", content=ANSWER)]
    assert pair.rejected == [Message(role="assistant", content="6")]


def test_preference_with_a_text_prompt_and_conversational_responses():
    raw = {"prompt": USER_Q, "chosen": [{"role": "assistant", "content": ANSWER}],
           "rejected": [{"role": "assistant", "content": "6"}]}
    pair = to_record(raw, "auto")
    assert pair.prompt == [Message(role="user", content=USER_Q)] and pair.chosen[0].content == ANSWER


# -- Anthropic HH-RLHF ------------------------------------------------------------------------------


def test_hh_rlhf_multi_turn_transcripts_split_at_the_first_difference():
    shared = "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: What is 2 plus 3?"
    raw = {"chosen": shared + "\n\nAssistant: 5", "rejected": shared + "\n\nAssistant: I don't know.\n\nHuman: ok"}
    pair, fmt = convert(raw, kind="preference")
    assert fmt == "hh_rlhf"
    assert [(m.role, m.content) for m in pair.prompt] == [
        ("user", "Hi there"), ("assistant", "Hello! How can I help?"), ("user", "What is 2 plus 3?")]
    assert [(m.role, m.content) for m in pair.chosen] == [("assistant", "5")]
    assert [(m.role, m.content) for m in pair.rejected] == [("assistant", "I don't know."), ("user", "ok")]


def test_hh_rlhf_keeps_multiline_turns_and_tolerates_a_missing_leading_blank_line():
    raw = {"chosen": "Human: List two fruits.\n\nAssistant: - apple\n- pear",
           "rejected": "\n\nHuman: List two fruits.\n\nAssistant: chair"}
    pair = to_record(raw, "auto")
    assert pair.prompt == [Message(role="user", content="List two fruits.")]
    assert pair.chosen[0].content == "- apple\n- pear"


@pytest.mark.parametrize(
    ("raw", "field", "category", "words"),
    [
        ({"chosen": "\n\nHuman: q", "rejected": "\n\nHuman: q\n\nAssistant: a"}, "chosen", NO_ASSISTANT,
         "no `\\n\\nAssistant:` turn"),
        ({"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: other\n\nAssistant: b"}, "prompt",
         EMPTY_PROMPT, "share no leading turns"),
        ({"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant:"}, "rejected[1]",
         EMPTY_MESSAGE, "turn 2 (`Assistant:`) is empty"),
        ({"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: a"}, "rejected",
         IDENTICAL_PAIR, "identical"),
        ({"chosen": "a fine answer", "rejected": "a bad one"}, "chosen", INVALID_VALUE, "give `prompt`"),
        ({"chosen": "preamble\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: b"}, "chosen",
         INVALID_VALUE, "text before its first turn"),
        ({"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: a\n\nHuman: more"},
         "chosen", NO_ASSISTANT, "after the turns it shares"),
    ],
)
def test_hh_rlhf_errors_say_what_is_wrong(raw, field, category, words):
    with pytest.raises(FormatError) as info:
        to_record(raw, "auto")
    assert (info.value.field, info.value.category) == (field, category)
    assert words in info.value.reason


# -- records that belong to another recipe ------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "kind", "found", "words"),
    [
        ({"prompt": "q", "answer": "4"}, "sft", "rl", ["RL prompt (`prompt` + `answer`", "SFT needs `messages`",
                                                      "`prompt` + `completion`", "posttrain sample"]),
        (EXAMPLES["preference"], "sft", "preference", ["preference pair", "drop `rejected`", "posttrain dpo"]),
        (EXAMPLES["hh_rlhf"], "sft", "preference", ["HH-RLHF", "SFT needs"]),
        (EXAMPLES["messages"], "preference", "sft", ["SFT chat", "needs `prompt` + `chosen` + `rejected`",
                                                     "posttrain feedback"]),
        (EXAMPLES["prompt_completion"], "preference", "sft", ["`prompt` + `completion`/`response`"]),
        (EXAMPLES["rl"], "preference", "rl", ["RL prompt", "posttrain sample"]),
        (EXAMPLES["alpaca"], "rl", "sft", ["Alpaca", "RL needs", "add `answer`"]),
        (EXAMPLES["preference"], "rl", "preference", ["drop `chosen` and `rejected`"]),
    ],
)
def test_a_record_of_another_kind_says_what_it_is_and_how_to_convert(raw, kind, found, words):
    with pytest.raises(FormatError) as info:
        convert(raw, kind=kind)
    assert info.value.category == WRONG_KIND and info.value.found_kind == found
    for phrase in words:
        assert phrase in info.value.reason, (phrase, info.value.reason)


def test_every_pair_of_kinds_has_a_conversion_hint():
    kinds = sorted(set(FORMAT_KIND.values()))
    for fmt, found in FORMAT_KIND.items():
        for kind in kinds:
            if kind != found:
                with pytest.raises(FormatError, match="where"):
                    convert(dict(EXAMPLES[fmt]), kind=kind)


# -- prompts of any record ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_has_a_prompt(fmt):
    prompt, used = to_prompt(EXAMPLES[fmt])
    assert used == fmt and prompt.prompt[-1] == Message(role="user", content=USER_Q)
    assert all(m.role != "assistant" for m in prompt.prompt)


def test_a_chat_without_an_assistant_turn_is_all_prompt_and_answer_keys_go_to_meta():
    raw = {"messages": [{"role": "user", "content": "q"}], "answer": "4", "verifier": "exact", "id": "x"}
    prompt, _ = to_prompt(raw)
    assert prompt.prompt == [Message(role="user", content="q")] and prompt.id == "x"
    assert prompt.meta == {"answer": "4", "verifier": "exact"}
    with pytest.raises(FormatError) as info:
        to_prompt({"messages": [{"role": "assistant", "content": "only a reply"}]})
    assert (info.value.field, info.value.category) == ("messages", EMPTY_PROMPT)
