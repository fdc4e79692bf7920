"""``sft_fields`` against ``convert``: the same records accepted with the same fields, the same errors otherwise.

``sft_fields`` takes a shortcut for records in the usual shape (``_canonical``); these tests hold it side by side
with the full parser, on hand-picked records for every check the shortcut makes and on generated ones.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data.formats import FormatError, convert
from posttrain.data.json_text import TextEncoder, encode_string
from posttrain.data.records import messages_id, stable_id
from posttrain.data.sft_fields import SFTFields, _canonical
from posttrain.data.sft_fields import sft_fields as sft_fields_and_verbatim


def sft_fields(raw, fmt: str = "auto") -> SFTFields:
    return sft_fields_and_verbatim(raw, fmt)[0]


def _convert_fields(raw, fmt: str = "auto") -> SFTFields:
    record, _ = convert(raw, fmt, kind="sft")
    return SFTFields([m.model_dump() for m in record.messages], record.id, record.tier, record.difficulty, record.meta)


def _outcome(function, raw, fmt: str = "auto"):
    """The fields, or the error as everything a caller reads of it (message, field, category, kind)."""
    try:
        fields = function(raw, fmt)
    except FormatError as exc:
        return ("error", str(exc), exc.field, exc.category, exc.found_kind)
    except (TypeError, ValueError, OverflowError) as exc:  # not FormatError: still the same one from both
        return ("exception", type(exc).__name__, str(exc))
    return ("fields", fields, [list(m) for m in fields.messages], list(fields.meta))  # key order counts too


def _both(raw, fmt: str = "auto") -> tuple:
    """What ``sft_fields`` and ``convert`` make of ``raw``: fields, or the error's type and words."""
    return _outcome(sft_fields, raw, fmt), _outcome(_convert_fields, raw, fmt)


def _chat(*turns, **extra) -> dict:
    return {"messages": [{"role": role, "content": text} for role, text in turns], **extra}


QA = (("user", "What is 2 + 2?"), ("assistant", "4"))

# Records the shortcut takes: each must give exactly what convert gives.
CANONICAL = [
    {"prompt": "What is 2 + 2?", "response": "4"},
    {"prompt": "What is 2 + 2?", "completion": "4"},
    {"prompt": "  padded ", "response": "\tfour\n", "id": 17, "tier": 2.0, "difficulty": 3},
    {"prompt": "q", "response": "a", "id": "given", "tier": 3, "difficulty": 0.5, "kind": "sft"},
    {"prompt": "q", "response": "a", "meta": {"source": "x", "n": [1, 2]}, "zeta": 1, "alpha": {"b": None}},
    {"prompt": "q", "response": "a", **{f"key{i}": i for i in (5, 1, 7, 4, 2, 6, 3, 0)}},  # into meta in key order
    {"prompt": "q", "response": "a", "tier": None, "meta": None, "answer": "42"},  # nulls are absent; answer → meta
    {"prompt": "ünïcödé ✓ 漢字", "response": "a\x7fb \u2028 \U0001f600 \"quoted\" \\u0041"},
    _chat(*QA),
    _chat(("system", ""), *QA, ("user", "more"), ("assistant", "sure"), ("tool", "")),
    _chat(*QA, id=5, extra={"nested": [1]}),
    {"messages": [{"role": "user", "content": "hi", "name": "bob"}, {"role": "assistant", "content": "yo"}]},
]

# Records the shortcut leaves to convert: every one must still be refused (or taken) exactly as convert does.
DEFERRED = [
    _chat(("user", "hi"), ("robot", "yo")),  # unknown role
    _chat(("User", "hi"), ("assistant", "yo")),
    _chat(("user", "hi"), ("assistant", "   ")),  # blank reply
    _chat(("user", "hi"), ("assistant", "a\x00b")),  # NUL
    _chat(("system", "a\x00b"), *QA),
    _chat(("assistant", "first"), ("user", "then")),  # assistant first
    _chat(("user", "hi"), ("user", "no reply")),  # no assistant turn
    {"messages": []},
    {"messages": "hello"},
    {"messages": ["hello"]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": 1, "content": "x"}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]},
    {"prompt": "q", "response": ""},
    {"prompt": "", "response": "a"},
    {"prompt": "q", "response": 5},
    {"prompt": 5, "response": "a"},
    {"prompt": "q", "completion": "a", "response": "b"},
    {"prompt": [{"role": "user", "content": "q"}], "response": "a"},
    {"prompt": "q", "response": [{"role": "assistant", "content": "a"}]},
    {"prompt": "q"},  # an RL prompt: wrong kind
    {"prompt": "q", "chosen": "a", "rejected": "b"},
    {"instruction": "Do it", "output": "done"},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    {"prompt": "q", "response": "a", "id": ""},
    {"prompt": "q", "response": "a", "id": " "},
    {"prompt": "q", "response": "a", "id": True},
    {"prompt": "q", "response": "a", "id": 3.5},
    {"prompt": "q", "response": "a", "tier": 4},
    {"prompt": "q", "response": "a", "tier": "1"},
    {"prompt": "q", "response": "a", "tier": True},
    {"prompt": "q", "response": "a", "tier": 2.5},
    {"prompt": "q", "response": "a", "difficulty": "hard"},
    {"prompt": "q", "response": "a", "difficulty": True},
    {"prompt": "q", "response": "a", "difficulty": math.nan},
    {"prompt": "q", "response": "a", "difficulty": math.inf},
    {"prompt": "q", "response": "a", "kind": "rl"},
    {"prompt": "q", "response": "a", "kind": 3},
    {"prompt": "q", "response": "a", "meta": '{"a": 1}'},
    {"prompt": "q", "response": "a", "meta": "nope"},
    {"prompt": "q", "response": "a", "meta": [1]},
    {"prompt": "q", "response": "a", "meta": {"x": 1}, "x": 2},  # a key both top-level and in meta
    {"prompt": "q", "response": "a", "meta": {1: "non-string key"}},
    {"prompt": "q", "response": "a", 7: "non-string top-level key"},
    {"prompt": "q\ud800", "response": "a"},  # a lone surrogate: the id cannot be hashed
    {"foo": 1},
    [1, 2],
    "text",
]


@pytest.mark.parametrize("raw", CANONICAL, ids=range(len(CANONICAL)))
def test_records_in_the_usual_shape_take_the_shortcut_and_get_convert_s_fields(raw):
    assert _canonical(raw, "auto") is not None
    ours, theirs = _both(raw)
    assert ours == theirs


def test_only_the_shortcut_s_texts_are_called_the_record_s_own():
    for raw in CANONICAL:
        fields, verbatim = sft_fields_and_verbatim(raw)
        own = [m["content"] for m in raw["messages"]] if "messages" in raw else list(raw.values())
        assert verbatim and all(any(m["content"] is text for text in own) for m in fields.messages), raw
    for raw in ({"instruction": "Do it", "input": "with this", "output": "done"},
                {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}):
        fields, verbatim = sft_fields_and_verbatim(raw)
        assert not verbatim and fields.messages[-1]["role"] == "assistant"


@pytest.mark.parametrize("raw", DEFERRED, ids=range(len(DEFERRED)))
def test_anything_else_is_left_to_convert_and_refused_or_taken_as_it_does(raw):
    assert _canonical(raw, "auto") is None
    ours, theirs = _both(raw)
    assert ours == theirs


def test_an_explicit_format_is_honoured():
    cases = [({"prompt": "q", "response": "a"}, "prompt_completion"),
             ({"prompt": "q", "response": "a"}, "messages"),  # convert: `messages` is missing
             (_chat(*QA), "prompt_completion"), (_chat(*QA), "sharegpt"), (_chat(*QA), "no-such-format")]
    for raw, fmt in cases:
        ours, theirs = _both(raw, fmt)
        assert ours == theirs, (raw, fmt)


def test_a_bad_record_keeps_convert_s_words():
    with pytest.raises(FormatError) as caught:
        sft_fields(_chat(("user", "hi"), ("robot", "yo")))
    assert str(caught.value) == "`messages[1].role`: unknown role 'robot'; expected one of ['system', 'user', " \
        "'assistant', 'tool']"  # fmt: skip
    with pytest.raises(FormatError, match=r"`messages`: has no messages"):
        sft_fields({"messages": []})
    with pytest.raises(FormatError, match=r"`tier`: expected an integer 1-3, got str"):
        sft_fields({"prompt": "q", "response": "a", "tier": "1"})


_TEXT = st.text(st.sampled_from(list("ab \t\n\x00\x7f\"\\éß漢\u2028") + ["\ud800", "\U0001f600"]), max_size=6)
_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=True), _TEXT,
                   st.lists(st.integers(0, 2), max_size=2))  # fmt: skip
_ROLE = st.sampled_from(["user", "assistant", "system", "tool", "robot", "User", None, 3])
_MESSAGE = st.fixed_dictionaries({}, optional={"role": _ROLE, "content": st.one_of(_TEXT, _VALUE), "name": _TEXT})
_RECORD = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.one_of(st.lists(_MESSAGE, max_size=4), _VALUE),
        "prompt": st.one_of(_TEXT, _VALUE),
        "response": st.one_of(_TEXT, _VALUE),
        "completion": st.one_of(_TEXT, _VALUE),
        "id": _VALUE,
        "tier": st.one_of(_VALUE, st.sampled_from([1, 2.0, 3])),
        "difficulty": _VALUE,
        "kind": st.sampled_from(["sft", "rl", None, 1]),
        "meta": st.one_of(st.dictionaries(_TEXT, _VALUE, max_size=2), _VALUE, st.just('{"k": 1}')),
        "extra": _VALUE,
        "k": _VALUE,
    },
)


# Mostly well-formed records with a few odd values, so that many take the shortcut and many just miss it.
_ODD = ["\t", "\x00", "\x7f", '"', "\\", "é", "漢", "\ud800", "\U0001f600"]
_WORDS = st.text(st.sampled_from(list("abcdefghij  " * 4) + _ODD), max_size=8)
_TAGS = {
    "id": st.one_of(_WORDS, _WORDS, st.integers(-1, 99), _VALUE),
    "tier": st.sampled_from([1, 2, 3, 2.0, 1, 2, 3, 0, 4, 2.5, "1", True]),
    "difficulty": st.one_of(st.floats(allow_nan=False), st.floats(allow_nan=False), st.integers(-5, 5), _VALUE),
    "kind": st.sampled_from(["sft", "sft", "sft", "rl", 1]),
    "meta": st.one_of(st.dictionaries(st.sampled_from(["a", "extra", "n"]), _VALUE, max_size=2), _VALUE),
    "extra": _VALUE,
    "a": _VALUE,
}
_GOOD_TAGS = {
    "id": st.one_of(_WORDS, st.integers(0, 99)),
    "tier": st.sampled_from([1, 2, 3, 2.0]),
    "difficulty": st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-5, 5)),
    "kind": st.just("sft"),
    "meta": st.dictionaries(st.sampled_from(["m", "n"]), _VALUE, max_size=2),
    "extra": _VALUE,
}
_NEAR_PAIRS = st.one_of(*(st.fixed_dictionaries({"prompt": _WORDS, "response": _WORDS}, optional=tags)
                          for tags in ({**_TAGS, "completion": _WORDS}, _GOOD_TAGS)))  # fmt: skip
_TURN = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "robot"]),
                               "content": _WORDS})  # fmt: skip
_GOOD_CHAT = st.tuples(st.lists(_TURN, max_size=2), _TURN, _TURN, st.lists(_TURN, max_size=2)).map(
    lambda parts: [*parts[0], {**parts[1], "role": "user"}, {**parts[2], "role": "assistant"}, *parts[3]])
_NEAR_CHATS = st.one_of(st.fixed_dictionaries({"messages": st.lists(_TURN, max_size=4)}, optional=_TAGS),
                        st.fixed_dictionaries({"messages": _GOOD_CHAT}, optional=_GOOD_TAGS))  # fmt: skip


@settings(max_examples=600, deadline=None)
@given(raw=st.one_of(_RECORD, _NEAR_PAIRS, _NEAR_CHATS), fmt=st.sampled_from(["auto", "auto", "messages",
                                                                               "prompt_completion"]))  # fmt: skip
def test_generated_records_give_the_same_fields_or_the_same_error(raw, fmt):
    ours, theirs = _both(raw, fmt)
    assert ours == theirs


@settings(max_examples=300, deadline=None)
@given(value=st.recursive(st.one_of(_TEXT, st.integers(), st.floats(allow_nan=False), st.none()),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                          max_leaves=8))  # fmt: skip
def test_text_json_is_json_dumps_without_ascii_escapes(value):
    try:
        expected = json.dumps(value, ensure_ascii=False, default=str)
    except ValueError:  # a float nan/inf is fine; anything json refuses is refused here too
        expected = None
    if expected is None:
        with pytest.raises(ValueError):
            TextEncoder(default=str).encode(value)
    else:
        assert TextEncoder(default=str).encode(value) == expected
        assert not isinstance(value, str) or encode_string(value) == expected


@settings(max_examples=300, deadline=None)
@given(chat=st.lists(st.tuples(st.sampled_from(["user", "assistant", "x\x7f", "é"]), _TEXT), max_size=4))
def test_messages_id_is_the_stable_id_of_the_messages(chat):
    messages = [{"role": role, "content": content} for role, content in chat]
    try:
        expected, error = stable_id(messages, "sft-"), None
    except UnicodeEncodeError as exc:  # a lone surrogate cannot be hashed: the same error, at the same place
        expected, error = None, exc
    if error is not None:
        with pytest.raises(UnicodeEncodeError, match=re.escape(str(error))):
            messages_id(messages, "sft-")
    else:
        assert messages_id(messages, "sft-") == expected


@settings(max_examples=300, deadline=None)
@given(chat=st.lists(st.tuples(st.sampled_from(["user", "assistant", "x\x7f", "é"]),
                               st.text(st.sampled_from(list("ab \x7féß漢\u2028") + ["\U0001f600"]), max_size=6)),
                     max_size=4))  # fmt: skip
def test_messages_id_of_texts_known_to_need_no_escape_skips_the_check_and_gets_the_same_id(chat):
    messages = [{"role": role, "content": content} for role, content in chat]
    assert messages_id(messages, "sft-", unescaped=True) == stable_id(messages, "sft-")
