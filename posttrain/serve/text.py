"""What the feedback service accepts as text: visible when it must not be empty, storable everywhere.

Both rules exist because of what a client can send and the stores cannot take, or a reader cannot see:

- ``is_blank``: a text made only of whitespace or of characters that draw nothing (zero-width spaces,
  joiners, the byte-order mark, soft hyphens, lone combining marks, Hangul and Braille fillers) is blank.
  ``str.strip()`` alone misses most of them (U+200B is not whitespace to Python), so a "reason" of one
  zero-width space passed the old check.
- ``json_problem``: a request body nested deeper than ``MAX_DEPTH`` levels, a string holding a lone
  surrogate (``"\\ud800"`` is valid JSON but not encodable as UTF-8) or a NUL character (PostgreSQL
  ``text`` cannot hold one) is refused with the reason, before pydantic or a database driver fails on it
  half-way through a request.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

MAX_DEPTH = 32  # containers inside containers, counting the request body itself as level 1

# Categories that never draw a glyph on their own: separators, controls, format characters (U+200B–U+200F,
# U+2060–U+2064, U+FEFF, U+00AD, tags …), and combining marks with no base character to sit on.
_INVISIBLE_CATEGORIES = {"Zs", "Zl", "Zp", "Cc", "Cf", "Mn", "Me"}
# Letters and symbols that are drawn as blank space although their category says otherwise.
_BLANK_LOOKING = {"\u115f", "\u1160", "\u3164", "\uffa0", "\u2800"}


def is_blank(text: str) -> bool:
    """True when ``text`` shows nothing a reader could take for content (see the module docstring)."""
    return not any(not (ch.isspace() or ch in _BLANK_LOOKING or unicodedata.category(ch) in _INVISIBLE_CATEGORIES)
                   for ch in text)  # fmt: skip


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored as-is on both backends, or None."""
    if "\x00" in text:
        return "contains a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}"
    return None


def json_problem(value: Any, max_depth: int = MAX_DEPTH) -> str | None:
    """Why a parsed JSON value cannot be taken (too deep, an unstorable string or key), or None.

    Walks iteratively, so a value nested thousands of levels deep costs a loop, not Python's recursion limit.
    The message names the top-level field where the problem is.
    """
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, field = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem:
                return f"{field or 'a text'} {problem}"
        elif isinstance(item, dict | list):
            if depth > max_depth:
                return f"{field or 'the body'} is nested more than {max_depth} levels deep (the limit is {max_depth} levels)"
            pairs = item.items() if isinstance(item, dict) else ((None, v) for v in item)
            for key, child in pairs:
                if key is not None:
                    problem = text_problem(str(key))
                    if problem:
                        return f"a key in {field or 'the body'} {problem}"
                stack.append((child, depth + 1, field or (str(key) if key is not None else "")))
    return None


def json_chars(value: Any) -> int:
    """Characters of ``value`` as the store keeps it (compact JSON, UTF-8 kept; key order does not change it)."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
