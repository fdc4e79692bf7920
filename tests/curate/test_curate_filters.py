"""Each heuristic rule on a crafted failing record and a passing one; normalisation; raw-line parsing."""

from __future__ import annotations

import json

import pytest

from posttrain.curate.config import FiltersConfig, NormalizeConfig
from posttrain.curate.filters import FILTERS, FilterStage, register_filter
from posttrain.curate.normalize import NormalizeStage, normalize_text
from posttrain.curate.rows import FUNNEL_REASONS, Row, parse_line
from posttrain.data.formats import CATEGORIES
from posttrain.data.records import SFTExample

GOOD_PROMPT = "Explain why the sky looks blue during the day."
GOOD_RESPONSE = (
    "Sunlight is scattered by the molecules of the air. Blue light has a shorter wavelength than red "
    "light, so it is scattered much more strongly, and the scattered blue light reaches our eyes from "
    "every direction of the sky."
)


def row(prompt: str = GOOD_PROMPT, response: str = GOOD_RESPONSE, control: int = 0) -> Row:
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return Row(index=0, source="test", line=1, id="r", messages=messages, raw_control_chars=control)


def reason(record: Row, **overrides) -> str | None:
    verdict = FilterStage(FiltersConfig(**overrides)).apply([record])[0]
    return verdict.reason if verdict else None


def test_a_clean_record_passes_every_rule():
    assert reason(row()) is None


def repeated_lines(n: int) -> str:
    return "\n".join(["Buy now and save big on every item."] * n + [f"Line {i} is unique here." for i in range(3)])


CASES = [
    ("empty_prompt", row(prompt=""), {}),
    ("prompt_too_short", row(prompt="Hi"), {}),
    ("prompt_too_long", row(prompt="word " * 50), {"max_prompt_chars": 100}),
    ("empty_response", row(response=""), {}),
    ("response_too_short", row(response="ok"), {"min_response_chars": 5}),
    ("response_too_long", row(response="word " * 50), {"max_response_chars": 100}),
    ("prompt_equals_response", row(prompt=GOOD_PROMPT, response=GOOD_PROMPT.upper()), {}),
    ("garbled_replacement_chars", row(response=GOOD_RESPONSE + " caf\ufffd"), {}),
    ("garbled_mojibake", row(response="The cafÃ© isnâ€™t open and the crÃ¨me is gone."), {}),
    ("garbled_nonprintable", row(control=40), {}),
    ("symbol_word_ratio", row(response="# one # two # three ... # four ### five"), {}),
    ("mean_word_length_low", row(prompt="a b c d e f g h", response="i j k l m n o p"), {}),
    ("mean_word_length_high", row(response="Supercalifragilisticexpialidocious " * 5), {}),
    ("alpha_word_ratio", row(response="1 2 3 4 5 6 7 8 9 10 11 12"), {"min_alpha_word_ratio": 0.8}),
    ("duplicate_lines", row(response=repeated_lines(12)), {"repetition_min_words": 10}),
    ("top_ngram_repetition", row(response="the cat " * 20 + GOOD_RESPONSE), {"repetition_min_words": 10}),
    (
        "duplicate_ngram_repetition",
        row(response=(GOOD_RESPONSE + " ") * 2),
        {"repetition_min_words": 10, "max_top_ngram_char_fraction": {}},
    ),
    ("banned_phrase", row(response="As an AI language model, I cannot have opinions on that."), {}),
]


@pytest.mark.parametrize("expected,record,overrides", CASES, ids=[c[0] for c in CASES])
def test_rule_drops_its_crafted_record(expected, record, overrides):
    assert reason(record, **overrides) == expected


@pytest.mark.parametrize("expected,record,overrides", CASES, ids=[c[0] for c in CASES])
def test_rule_switched_off_lets_the_record_through_that_rule(expected, record, overrides):
    off = {
        "empty_prompt": {"min_prompt_chars": None},
        "prompt_too_short": {"min_prompt_chars": None},
        "prompt_too_long": {"max_prompt_chars": None},
        "empty_response": {"min_response_chars": None},
        "response_too_short": {"min_response_chars": None},
        "response_too_long": {"max_response_chars": None},
        "prompt_equals_response": {"drop_prompt_equals_response": False},
        "garbled_replacement_chars": {"max_replacement_char_ratio": None},
        "garbled_mojibake": {"max_mojibake_ratio": None},
        "garbled_nonprintable": {"max_nonprintable_ratio": None},
        "symbol_word_ratio": {"max_symbol_word_ratio": None},
        "mean_word_length_low": {"min_mean_word_length": None},
        "mean_word_length_high": {"max_mean_word_length": None},
        "alpha_word_ratio": {"min_alpha_word_ratio": None},
        "duplicate_lines": {"max_duplicate_line_fraction": None, "max_duplicate_line_char_fraction": None},
        "top_ngram_repetition": {"max_top_ngram_char_fraction": {}},
        "duplicate_ngram_repetition": {"max_duplicate_ngram_char_fraction": {}},
        "banned_phrase": {"banned_phrases": []},
    }[expected]
    assert reason(record, **{**overrides, **off}) != expected


def test_repetition_rules_skip_short_texts():
    short = row(response="the cat the cat the cat the cat")
    assert reason(short) is None
    assert reason(short, repetition_min_words=4, repetition_allowance=0) == "top_ngram_repetition"  # Gopher's rule
    # The default allowance (4 coincidental repeats) is most of an 8-word text: it passes.
    assert reason(short, repetition_min_words=4) is None


def test_filter_registry_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_filter("length")(lambda r, c: None)
    assert list(FILTERS)[0] == "length"


# -- normalisation -------------------------------------------------------------------------------
def test_normalize_nfc_whitespace_and_control_characters():
    config = NormalizeConfig()
    text, removed = normalize_text("  Cafe\u0301\x00 is\t\t open\u200b\r\n\r\n\r\n\r\n\r\nyes  ", config)
    assert text == "Café is open\n\n\nyes"
    assert removed == 2  # NUL and the zero-width space
    record = row(prompt="e\u0301\x07", response="fine\x1b answer")
    NormalizeStage(config).apply([record])
    assert record.prompt == "é" and record.response == "fine answer" and record.raw_control_chars == 2


def test_normalize_can_keep_control_characters():
    text, removed = normalize_text("a\x07b", NormalizeConfig(strip_control=False))
    assert text == "a\x07b" and removed == 0


# -- raw lines -----------------------------------------------------------------------------------
def parsed(raw: bytes):
    return parse_line(raw, index=7, source="in.jsonl", line=8)


@pytest.mark.parametrize(
    "record",
    [
        {"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]},
        {"prompt": "Q?", "response": "A."},
        {"prompt": [{"role": "user", "content": "Q?"}], "completion": "A."},
        {"instruction": "Q?", "input": "", "output": "A."},
        {"conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A."}]},
        {"conversations": [{"from": "user", "value": "Q?"}, {"from": "model", "value": "A."}]},
        {"prompt": "Q?", "completion": [{"role": "assistant", "content": "A."}]},
    ],
)
def test_accepted_record_shapes(record):
    result = parsed(json.dumps(record).encode())
    assert isinstance(result, Row)
    assert (result.prompt, result.response, result.line, result.index) == ("Q?", "A.", 8, 7)


def test_ids_are_kept_or_derived_from_content():
    assert parsed(b'{"id": "abc", "prompt": "Q?", "response": "A."}').id == "abc"
    first = parsed(b'{"prompt": "Q?", "response": "A."}').id
    assert first == parsed(b'{"prompt": "Q?",  "response": "A."}').id != parsed(b'{"prompt": "Q", "response": "A."}').id
    # The same id training gives the record: curation and SFT read through one parser.
    assert first == SFTExample(messages=[{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]).id


@pytest.mark.parametrize(
    "raw,expected",
    [
        (b"\xff\xfe not utf-8", "invalid_utf8"),
        (b'{"prompt": "\\ud800", "response": "x"}', "invalid_utf8"),
        (b"{not json", "malformed_json"),
        (b"[1, 2]", "unknown_format"),
        (b'{"text": "hello"}', "unknown_format"),
        (b'{"prompt": "Q?"}', "missing_response"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "bad_field"),
        (b'{"messages": "nope"}', "bad_field"),
        (b'{"instruction": 3, "output": "x"}', "bad_field"),
        (b'{"instruction": "Q?"}', "bad_field"),
        (b'{"prompt": "Q?", "response": "  "}', "empty_response"),
        (b'{"instruction": "Q?", "output": ""}', "empty_response"),
        (b'{"prompt": " ", "response": "A."}', "empty_prompt"),
        (b'{"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": ""}]}', "empty_message"),
        (b'{"messages": [{"role": "user", "content": "Q?"}]}', "missing_response"),
        (b'{"prompt": "Q?", "answer": "4"}', "missing_response"),
        (b'{"prompt": "Q?", "chosen": "A.", "rejected": "B."}', "wrong_kind"),
        (b'{"chosen": "\\n\\nHuman: Q?\\n\\nAssistant: A.", "rejected": "\\n\\nHuman: Q?\\n\\nAssistant: B."}',
         "wrong_kind"),
        (b'{"prompt": "Q?", "response": "A.", "tier": 7}', "bad_field"),
        (b"   ", "blank_line"),
        (b"[" * 100_000 + b"]" * 100_000, "malformed_json"),
    ],
)
def test_bad_lines_become_named_drops(raw, expected):
    result = parsed(raw)
    assert not isinstance(result, Row)
    drop, text = result
    assert drop.reason == expected and isinstance(text, str) and drop.detail


def test_every_data_layer_category_has_a_funnel_reason():
    assert set(FUNNEL_REASONS) == set(CATEGORIES)
    assert all(reason.isidentifier() and reason.islower() for reason in FUNNEL_REASONS.values())


def test_a_drop_says_how_to_convert_a_record_of_another_kind():
    drop, _ = parsed(b'{"prompt": "Q?", "answer": "4"}')
    assert "SFT needs `messages`" in drop.detail and "`prompt` + `completion`" in drop.detail
