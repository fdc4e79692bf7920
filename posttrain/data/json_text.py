"""``json.dumps(value, ensure_ascii=False, ...)`` at the speed of the ASCII escaper wherever the text allows.

Every JSONL line posttrain writes and every content-hash id (``records.stable_id``) keep non-ASCII characters
as they are (``ensure_ascii=False``). The standard library's C escaper for that is 2.5x slower than its
ASCII-only twin (on 30 000 long records: 0.33 s against 0.13 s). The two write the same text except where the
ASCII one writes a ``\\uXXXX`` escape (every non-ASCII character, and DEL), so an ASCII encoding without ``\\u``
in it *is* the ``ensure_ascii=False`` text. Only other values (non-ASCII text, DEL or other control characters,
a literal backslash before a ``u``) are encoded a second time, the usual way.
"""

from __future__ import annotations

import json
from json.encoder import c_make_encoder, encode_basestring, encode_basestring_ascii
from typing import Any

_CHAT_KEYS = ("role", "content")
# ``string_body_utf8`` of the chat roles, looked up instead of encoded twice a message (a role is a short string: a
# dict lookup hashes it at no cost, where looking up a long text would hash all of it).
ROLES_UTF8 = {role: role.encode("utf-8") for role in ("system", "user", "assistant", "tool")}


class TextEncoder:
    """Encodes like ``json.dumps(value, ensure_ascii=False, **options)``, byte for byte."""

    def __init__(self, **options: Any):
        self._ascii = json.JSONEncoder(ensure_ascii=True, **options)
        self._text = json.JSONEncoder(ensure_ascii=False, **options)
        # The C encoders ``JSONEncoder.encode`` builds on every call, built once: encoding a small dict (a kept
        # record's meta) then takes 2.7 µs instead of 4.5. Without the circular-reference check, which only the
        # standard path below makes: a value this one cannot encode goes there, and fails there as json.dumps fails.
        self._c = None
        if c_make_encoder is not None and self._ascii.indent is None:
            self._c = tuple(c_make_encoder(None, encoder.default, escape, None, encoder.key_separator,
                                           encoder.item_separator, encoder.sort_keys, encoder.skipkeys,
                                           encoder.allow_nan)
                            for encoder, escape in ((self._ascii, encode_basestring_ascii),
                                                    (self._text, encode_basestring)))  # fmt: skip
        # Chats are framed by hand only where that gives the same text: default separators, keys unsorted, one line.
        self._frames_chats = not ({"separators", "sort_keys", "indent"} & options.keys())

    def encode(self, value: Any) -> str:
        if self._c is not None:
            try:
                text = "".join(self._c[0](value, 0))
                return "".join(self._c[1](value, 0)) if "\\u" in text else text
            except Exception:  # noqa: BLE001, S110 - told below, as json.dumps tells it
                pass
        text = self._ascii.encode(value)
        return self._text.encode(value) if "\\u" in text else text

    def encode_chat_utf8(self, messages: Any, plain: tuple[str, ...] = ()) -> bytes:
        """``encode(messages).encode("utf-8")`` for a chat. A list of ``{"role": str, "content": str}`` dicts is
        framed here in bytes, each text's own UTF-8 taken as it is where it needs no escape (``string_body_utf8``):
        the C encoder takes 3x as long over a chat of long texts, mostly building and joining its pieces, and its
        text is then encoded again. Anything else: ``encode``. A lone surrogate raises ``UnicodeEncodeError``.
        ``plain``: texts the caller knows need no escape (compared by identity), encoded without the check."""
        pieces: list[bytes] = []
        self.chat_utf8_pieces(messages, pieces, plain)
        return b"".join(pieces)

    def chat_utf8_pieces(self, messages: Any, pieces: list[bytes], plain: tuple[str, ...] = ()) -> None:
        """Append ``encode_chat_utf8(messages, plain)`` to ``pieces`` in parts, for a caller that joins a longer
        line once (each long text is then copied once, into the line)."""
        if not self._frames_chats or type(messages) is not list:
            pieces.append(self.encode(messages).encode("utf-8"))
            return
        start, opening = len(pieces), b'[{"role": "'
        for message in messages:
            if type(message) is not dict or tuple(message) != _CHAT_KEYS:
                break
            role, content = message["role"], message["content"]
            if type(role) is not str or type(content) is not str:
                break
            for text in plain:
                if content is text:
                    body = content.encode()
                    break
            else:
                body = string_body_utf8(content)
            pieces += (opening, ROLES_UTF8.get(role) or string_body_utf8(role), b'", "content": "', body, b'"}')
            opening = b', {"role": "'
        else:
            pieces.append(b"]" if messages else b"[]")
            return
        del pieces[start:]  # not a plain chat after all: the generic encoder writes it
        pieces.append(self.encode(messages).encode("utf-8"))


# The characters ``ensure_ascii=False`` escapes: the quote, the backslash and the C0 controls. As UTF-8 bytes, which
# encode nothing else below 0x80, so a text whose UTF-8 form holds none of them is written as it is, between quotes.
_ESCAPED_BYTES = bytes(range(0x20)) + b'"\\'


def string_body_utf8(text: str) -> bytes:
    """The UTF-8 bytes of ``encode_string(text)`` without its quotes: ``text``'s own UTF-8 when it needs no escape
    (so that a hash of JSON can take a long text without copying it into a JSON string first). Raises
    ``UnicodeEncodeError`` for a lone surrogate, as encoding the JSON text would."""
    data = text.encode("utf-8")
    if len(data.translate(None, _ESCAPED_BYTES)) == len(data):
        return data
    return encode_string(text)[1:-1].encode("utf-8")


def encode_string(text: str) -> str:
    """``json.dumps(text, ensure_ascii=False)`` for a str. Most texts need no escape at all, which two C passes tell
    (encode, then delete the escaped bytes and compare lengths: 2x faster than the ASCII escaper, which rebuilds
    the text character by character); the rest go by ``TextEncoder``'s rule. A lone surrogate cannot be encoded
    to UTF-8 and goes that way too."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = b"\\"
    if len(data.translate(None, _ESCAPED_BYTES)) == len(data):
        return f'"{text}"'
    out = encode_basestring_ascii(text)
    return encode_basestring(text) if "\\u" in out else out
