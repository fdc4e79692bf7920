"""Each verifier on hand-written outputs that must pass and outputs that must fail."""

from __future__ import annotations

import pytest

from posttrain.eval.items import EvalItem, _Registry
from posttrain.eval.verifiers import (
    VERIFIERS,
    check_item,
    extract_choice,
    extract_code,
    extract_number,
    normalize,
    register_verifier,
    verify,
)


def item(verifier: str, answer=None, **kwargs) -> EvalItem:
    return EvalItem(id="x", prompt="q", verifier=verifier, answer=answer, **kwargs)


def test_normalize():
    assert normalize("  The   Answer.  ") == "the answer"
    assert normalize("Straße") == normalize("STRASSE")


@pytest.mark.parametrize("output", ["olleh", "  OLLEH. ", "olleh\n"])
def test_exact_passes(output):
    assert verify(item("exact", "olleh"), output).passed


@pytest.mark.parametrize("output", ["olleh!", "the answer is olleh", "oll eh", ""])
def test_exact_fails(output):
    result = verify(item("exact", "olleh"), output)
    assert not result.passed and result.score == 0.0 and "expected 'olleh'" in result.detail


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("The answer is 42", 42.0),
        ("12 + 30 = 42.", 42.0),
        ("It costs 1,234.5 dollars", 1234.5),
        ("-7", -7.0),
        ("\u22123", -3.0),
        ("about .5 of it", 0.5),
        ("3/4", 0.75),
        ("Answer: 17 because 17 > 3 and 3 < 100", 17.0),
        ("first answer: 1, final answer: 2 (not 3)", 2.0),
        ("1e3", 1000.0),
    ],
)
def test_extract_number(text, value):
    found = extract_number(text)
    assert found is not None and found[0] == pytest.approx(value)


def test_extract_number_none():
    assert extract_number("no digits here") is None
    assert extract_number("answer: none") is None


def test_numeric_pass_fail_and_tolerance():
    assert verify(item("numeric", "42"), "so the answer: 42").passed
    assert verify(item("numeric", "1,000"), "1000").passed
    assert verify(item("numeric", "0.75"), "3/4").passed
    assert not verify(item("numeric", "42"), "41").passed
    assert not verify(item("numeric", "42"), "42 is wrong, the answer is 43").passed
    assert verify(item("numeric", "3.14159", options={"tolerance": 0.01}), "3.14").passed
    assert not verify(item("numeric", "3.14159"), "3.14").passed
    assert verify(item("numeric", "1000", options={"rel_tolerance": 0.01}), "1005").passed
    assert "no number" in verify(item("numeric", "1"), "none").detail


@pytest.mark.parametrize(
    ("text", "letter"),
    [("B", "B"), ("(c)", "C"), ("The answer is (D).", "D"), ("answer: E", "E"), ("I pick (B) because", "B"),
     ("A) the first one", "A"), ("A good option is C", "C"), ("Answer: A", "A")],
)
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter


def test_multiple_choice():
    assert verify(item("multiple_choice", "B"), "The answer is B").passed
    assert verify(item("multiple_choice", "(b)"), "B").passed
    result = verify(item("multiple_choice", "B"), "The answer is C")
    assert not result.passed and "expected B, chose C" in result.detail
    assert not verify(item("multiple_choice", "B"), "no idea").passed


def test_contains():
    assert verify(item("contains", "Paris"), "It is  paris, of course.").passed
    assert not verify(item("contains", "Paris"), "London").passed


def ifeval_item(*constraints):
    return item("ifeval", options={"constraints": list(constraints)})


@pytest.mark.parametrize(
    ("constraint", "good", "bad"),
    [
        ({"type": "min_words", "value": 3}, "one two three", "one two"),
        ({"type": "max_words", "value": 3}, "don't stop now", "a b c d"),
        ({"type": "min_sentences", "value": 2}, "One. Two!", "Only one."),
        ({"type": "max_sentences", "value": 1}, "Just one, really.", "One. Two? Three."),
        ({"type": "forbidden_words", "words": ["cat"]}, "A dog and a catalog.", "The Cat sat."),
        ({"type": "required_keywords", "words": ["apple", "ice cream"]}, "Apple with ice cream", "apple pie"),
        ({"type": "case", "value": "lower"}, "all lower 123", "Not lower"),
        ({"type": "case", "value": "upper"}, "ALL UPPER!", "ALL UPPEr"),
        ({"type": "json"}, '```json\n{"a": [1, 2]}\n```', "{'a': 1}"),
        ({"type": "bullet_count", "value": 2}, "Intro\n- one\n* two", "- one\n- two\n- three"),
        ({"type": "starts_with", "text": "Dear Sir"}, "dear sir, hello", "Hello, dear sir"),
        ({"type": "ends_with", "text": "Is there anything else?"}, "Done. Is there anything else? ", "Done."),
        ({"type": "max_chars", "value": 5}, " abcde ", "abcdef"),
        ({"type": "min_chars", "value": 5}, "abcde", "abcd"),
    ],
)
def test_each_ifeval_constraint(constraint, good, bad):
    assert verify(ifeval_item(constraint), good).passed
    result = verify(ifeval_item(constraint), bad)
    assert not result.passed and result.score == 0.0 and constraint["type"] in result.detail


def test_ifeval_partial_score_names_failures():
    result = verify(ifeval_item({"type": "case", "value": "lower"}, {"type": "max_words", "value": 2},
                                {"type": "json"}), "hello there friend")
    assert result.score == pytest.approx(1 / 3) and not result.passed
    assert "[1] max_words: 3 words" in result.detail and "[2] json" in result.detail


def test_extract_code():
    assert extract_code("Here:\n```python\nx = 1\n```\nand\n```py\ny = 2\n```") == "x = 1\n\n\ny = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"verifier": "exactt", "answer": "a"}, "verifier"),
        ({"verifier": "exact"}, "answer"),
        ({"verifier": "exact", "answer": "a", "options": {"tolerance": 1}}, "options.tolerance"),
        ({"verifier": "numeric", "answer": "forty"}, "answer"),
        ({"verifier": "numeric", "answer": "4", "options": {"tolerance": -1}}, "options.tolerance"),
        ({"verifier": "multiple_choice", "answer": "F"}, "answer"),
        ({"verifier": "ifeval", "options": {}}, "options.constraints"),
        ({"verifier": "ifeval", "options": {"constraints": [{"type": "max_word", "value": 3}]}}, "options.constraints.0"),
        ({"verifier": "ifeval", "options": {"constraints": [{"type": "max_words"}]}}, "options.constraints.0"),
        ({"verifier": "ifeval", "options": {"constraints": [{"type": "case", "value": "title"}]}}, "options.constraints.0"),
        ({"verifier": "ifeval", "options": {"constraints": [{"type": "json", "strict": True}]}}, "options.constraints.0"),
        ({"verifier": "code"}, "tests"),
        ({"verifier": "code", "tests": "assert True", "options": {"timeout_s": 0}}, "options.timeout_s"),
    ],
)
def test_check_item_rejects_bad_items(kwargs, field):
    problem = check_item(EvalItem(id="x", prompt="q", **kwargs))
    assert problem is not None and problem[0] == field


def test_check_item_suggests_the_nearest_name():
    problem = check_item(EvalItem(id="x", prompt="q", verifier="ifeval",
                                  options={"constraints": [{"type": "max_word", "value": 3}]}))
    assert "did you mean `max_words`" in problem[1]


def test_registry_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_verifier("exact")(lambda output, item, settings: None)
    registry = _Registry("thing")
    registry["a"] = 1
    with pytest.raises(ValueError):
        registry["a"] = 2
    assert set(VERIFIERS) >= {"exact", "numeric", "multiple_choice", "contains", "ifeval", "code"}
