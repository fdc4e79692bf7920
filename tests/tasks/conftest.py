"""A small stand-in for ``posttrain.eval.verifiers`` while the eval harness is being written.

It follows the verifier contract (names and option fields) closely enough to tell a right answer
from a wrong one; the tests switch to the real verifiers as soon as they can be imported.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _words(text: str) -> list[str]:
    return text.split()


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, flags=re.IGNORECASE) is not None


def _constraint_holds(text: str, c: dict[str, Any]) -> bool:
    kind = c["type"]
    stripped = text.strip()
    if kind == "min_words":
        return len(_words(text)) >= c["value"]
    if kind == "max_words":
        return len(_words(text)) <= c["value"]
    if kind == "required_keywords":
        return all(_has_word(text, w) for w in c["words"])
    if kind == "forbidden_words":
        return not any(_has_word(text, w) for w in c["words"])
    if kind == "case":
        letters = [ch for ch in text if ch.isalpha()]
        want_upper = c["value"] == "upper"
        return bool(letters) and all(ch.isupper() == want_upper for ch in letters)
    if kind == "json":
        try:
            json.loads(stripped)
        except ValueError:
            return False
        return True
    if kind == "bullet_count":
        return sum(1 for line in text.splitlines() if re.match(r"^\s*[-*]\s+\S", line)) == c["value"]
    if kind == "starts_with":
        return stripped.startswith(c["text"])
    if kind == "ends_with":
        return stripped.endswith(c["text"])
    if kind == "max_chars":
        return len(stripped) <= c["value"]
    if kind == "min_chars":
        return len(stripped) >= c["value"]
    raise AssertionError(f"the local checker does not know constraint type {kind!r}")


def local_verify(verifier: str, response: str, answer: str | None, options: dict[str, Any]) -> bool:
    if verifier == "exact":
        return " ".join(response.split()) == " ".join((answer or "").split())
    if verifier == "numeric":
        after = re.split(r"answer:", response, flags=re.IGNORECASE)[-1]
        numbers = _NUMBER.findall(after)
        return bool(numbers) and abs(float(numbers[-1]) - float(answer)) <= options.get("tolerance", 0)
    if verifier == "ifeval":
        return all(_constraint_holds(response, c) for c in options["constraints"])
    raise AssertionError(f"the local checker does not know verifier {verifier!r}")


@pytest.fixture(scope="session")
def verify():
    """``verify(verifier, response, answer, options) -> bool``."""
    return local_verify
