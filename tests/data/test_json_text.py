"""``TextEncoder.encode_chat_utf8``, ``encode_string`` and ``string_body_utf8`` write exactly what
``json.dumps(..., ensure_ascii=False)`` writes (in UTF-8 where they return bytes): chats framed by hand where they
are plain, and everything else (odd shapes, other encoder options) the usual way."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data.json_text import TextEncoder, encode_string, string_body_utf8

# Every character either encoder treats specially: quote, backslash, C0 controls, DEL, non-ASCII, line separators,
# a lone surrogate and an astral character; plus plain letters so that most texts take the unescaped path.
_TEXT = st.text(st.sampled_from(list('abc  "\\\x00\x01\x1f\t\n\r\x7f\x80éß漢\u2028\u2029') + ["\ud800", "\U0001f600"]),
                max_size=12)  # fmt: skip
_PLAIN = st.text(st.sampled_from(list("abcdefg hij.,!?éß漢")), max_size=40)
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "x\x7f", "é\n"]), "content": _TEXT | _PLAIN}),
    st.fixed_dictionaries({"content": _TEXT, "role": st.just("user")}),  # keys in the other order
    st.fixed_dictionaries({"role": st.just("user"), "content": _TEXT, "name": _TEXT}),  # an extra key
    st.fixed_dictionaries({"role": st.just("user"), "content": st.none() | st.integers() | st.lists(_TEXT, max_size=2)}),
    st.integers(), _TEXT,
)
_CHAT = st.one_of(st.lists(_MESSAGE, max_size=4), st.tuples(_MESSAGE), st.none(), _TEXT)


@settings(max_examples=500, deadline=None)
@given(chat=_CHAT)
def test_encode_chat_utf8_is_json_dumps_in_utf8(chat):
    for options in ({"default": str}, {}, {"sort_keys": True}, {"separators": (",", ":")}, {"indent": 1}):
        try:
            expected = json.dumps(chat, ensure_ascii=False, **options).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no UTF-8 for it either way
            with pytest.raises(UnicodeEncodeError):
                TextEncoder(**options).encode_chat_utf8(chat)
        else:
            assert TextEncoder(**options).encode_chat_utf8(chat) == expected, options


@settings(max_examples=500, deadline=None)
@given(text=_TEXT | _PLAIN)
def test_encode_string_is_json_dumps(text):
    assert encode_string(text) == json.dumps(text, ensure_ascii=False)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT | _PLAIN)
def test_string_body_utf8_is_the_json_string_in_utf8_without_quotes(text):
    try:
        expected = json.dumps(text, ensure_ascii=False)[1:-1].encode("utf-8")
    except UnicodeEncodeError:
        with pytest.raises(UnicodeEncodeError):
            string_body_utf8(text)
    else:
        assert string_body_utf8(text) == expected


def test_every_escaped_character_is_escaped_and_no_other():
    for code in [*range(0x80), 0xE9, 0x2028, 0xD800, 0x1F600]:
        text = f"a{chr(code)}b"
        assert encode_string(text) == json.dumps(text, ensure_ascii=False), hex(code)
