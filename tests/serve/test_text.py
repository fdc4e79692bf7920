"""The text rules of the feedback service (``posttrain.serve.text``): blank-looking texts, the depth limit,
strings no store can hold. The service-level behaviour is in tests/security/test_feedback_service.py."""

from __future__ import annotations

import pytest

from posttrain.serve.text import MAX_DEPTH, is_blank, json_chars, json_problem, text_problem


@pytest.mark.parametrize("text", ["", " ", "\u200b", "\u3000\u00a0", "\ufeff\u2060", "\u0301", "\u3164", "\u2800"])
def test_blank_looking_texts_are_blank(text):
    assert is_blank(text)


@pytest.mark.parametrize("text", ["x", "\u200bx", "cafe\u0301", "👩\u200d💻", "\U0001f3f4\U000e0067\U000e0062\U000e0073"
                                  "\U000e0063\U000e0074\U000e007f", "مرحبا", "。"])  # fmt: skip
def test_anything_visible_is_not_blank(text):
    assert not is_blank(text)


def _nested(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels - 1):
        value = {"k": value}
    return value


def test_the_depth_limit_counts_the_body_as_level_one():
    assert json_problem(_nested(MAX_DEPTH)) is None
    assert json_problem({"metadata": [_nested(MAX_DEPTH - 2)]}) is None
    problem = json_problem({"metadata": [_nested(MAX_DEPTH - 1)]})
    assert problem == f"metadata is nested more than {MAX_DEPTH} levels deep (the limit is {MAX_DEPTH} levels)"
    assert json_problem(_nested(100_000)) is not None  # iterative: no RecursionError however deep


def test_unstorable_strings_and_keys_are_named():
    assert text_problem("fine ✓") is None
    assert "lone surrogate U+D800 at character 2" in text_problem("ab\ud800")
    assert text_problem("a\x00b") == "contains a NUL character"
    assert json_problem({"prompt": "ok", "signal": {"detail": ["x", "\udfff"]}}).startswith("signal is not valid")
    assert json_problem({"metadata": {"\ud800": 1}}).startswith("a key in metadata is not valid Unicode")
    assert json_chars({"b": "é", "a": [1, 2]}) == len('{"b":"é","a":[1,2]}')
