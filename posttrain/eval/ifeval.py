"""Instruction-following constraints in the style of IFEval (Zhou et al. 2023, "Instruction-Following
Evaluation for Large Language Models"): each constraint is a small deterministic check written in code,
never a model's judgement.

A constraint is a dict ``{"type": NAME, **params}``; ``CONSTRAINTS[NAME]`` holds its checker and the
parameters it takes (checked when a suite loads, so a typo fails early instead of scoring zero).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORD = re.compile(r"\w+(?:['’-]\w+)*")
SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")


def count_words(text: str) -> int:
    """Words are runs of letters/digits, with inner apostrophes or hyphens ("don't", "well-known") kept."""
    return len(WORD.findall(text))


def count_sentences(text: str) -> int:
    """Sentences end with ., ! or ? followed by whitespace or the end; trailing text without one counts too."""
    pieces = SENTENCE_END.split(text)
    return sum(1 for piece in pieces if WORD.search(piece))


def bullet_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.lstrip().startswith(("- ", "* ")))


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, flags=re.IGNORECASE) is not None


def _strip_json_fence(text: str) -> str:
    text = text.strip()
    match = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, flags=re.DOTALL | re.IGNORECASE)
    return match.group(1) if match else text


Check = Callable[[str, dict[str, Any]], tuple[bool, str]]


@dataclass(frozen=True)
class Constraint:
    check: Check
    params: dict[str, type | tuple[type, ...]]
    choices: dict[str, tuple[str, ...]] | None = None


def _min_words(text, p):
    n = count_words(text)
    return n >= p["value"], f"{n} words, need at least {p['value']}"


def _max_words(text, p):
    n = count_words(text)
    return n <= p["value"], f"{n} words, allowed at most {p['value']}"


def _min_sentences(text, p):
    n = count_sentences(text)
    return n >= p["value"], f"{n} sentences, need at least {p['value']}"


def _max_sentences(text, p):
    n = count_sentences(text)
    return n <= p["value"], f"{n} sentences, allowed at most {p['value']}"


def _forbidden_words(text, p):
    used = [w for w in p["words"] if _has_word(text, w)]
    return not used, f"uses forbidden word(s): {', '.join(used)}"


def _required_keywords(text, p):
    missing = [w for w in p["words"] if not _has_word(text, w)]
    return not missing, f"missing keyword(s): {', '.join(missing)}"


def _case(text, p):
    # str.islower/isupper: every cased letter in that case and at least one cased letter (as in IFEval).
    if p["value"] == "lower":
        return text.islower(), "not all lowercase"
    return text.isupper(), "not all uppercase"


def _json(text, p):
    try:
        json.loads(_strip_json_fence(text))
    except json.JSONDecodeError as exc:
        return False, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    return True, ""


def _bullet_count(text, p):
    n = bullet_lines(text)
    return n == p["value"], f"{n} bullet points, need exactly {p['value']}"


def _starts_with(text, p):
    return text.strip().lower().startswith(p["text"].strip().lower()), f"does not start with {p['text']!r}"


def _ends_with(text, p):
    return text.strip().lower().endswith(p["text"].strip().lower()), f"does not end with {p['text']!r}"


def _max_chars(text, p):
    n = len(text.strip())
    return n <= p["value"], f"{n} characters, allowed at most {p['value']}"


def _min_chars(text, p):
    n = len(text.strip())
    return n >= p["value"], f"{n} characters, need at least {p['value']}"


CONSTRAINTS: dict[str, Constraint] = {
    "min_words": Constraint(_min_words, {"value": int}),
    "max_words": Constraint(_max_words, {"value": int}),
    "min_sentences": Constraint(_min_sentences, {"value": int}),
    "max_sentences": Constraint(_max_sentences, {"value": int}),
    "forbidden_words": Constraint(_forbidden_words, {"words": list}),
    "required_keywords": Constraint(_required_keywords, {"words": list}),
    "case": Constraint(_case, {"value": str}, {"value": ("lower", "upper")}),
    "json": Constraint(_json, {}),
    "bullet_count": Constraint(_bullet_count, {"value": int}),
    "starts_with": Constraint(_starts_with, {"text": str}),
    "ends_with": Constraint(_ends_with, {"text": str}),
    "max_chars": Constraint(_max_chars, {"value": int}),
    "min_chars": Constraint(_min_chars, {"value": int}),
}


def constraint_problem(spec: Any) -> str | None:
    """Why a constraint spec is malformed, or None when it is fine."""
    if not isinstance(spec, dict) or "type" not in spec:
        return f"each constraint must be a mapping with a `type` (got {spec!r})"
    kind = spec["type"]
    if kind not in CONSTRAINTS:
        import difflib

        guess = difflib.get_close_matches(str(kind), list(CONSTRAINTS), n=1)
        hint = f"did you mean `{guess[0]}`?" if guess else f"known: {', '.join(CONSTRAINTS)}"
        return f"unknown constraint type {kind!r}; {hint}"
    constraint = CONSTRAINTS[kind]
    params = {k: v for k, v in spec.items() if k != "type"}
    unknown = sorted(set(params) - set(constraint.params))
    if unknown:
        return f"constraint {kind!r}: unknown parameter(s) {', '.join(unknown)}; takes: {', '.join(constraint.params) or 'none'}"
    for name, expected in constraint.params.items():
        if name not in params:
            return f"constraint {kind!r}: missing parameter `{name}`"
        value = params[name]
        if not isinstance(value, expected) or isinstance(value, bool):
            return f"constraint {kind!r}: `{name}` must be {getattr(expected, '__name__', expected)} (got {value!r})"
        if expected is int and value < 0:
            return f"constraint {kind!r}: `{name}` must be >= 0 (got {value})"
        if expected is list and not all(isinstance(w, str) and w for w in value):
            return f"constraint {kind!r}: `{name}` must be a list of non-empty strings"
    for name, allowed in (constraint.choices or {}).items():
        if params[name] not in allowed:
            return f"constraint {kind!r}: `{name}` must be one of {', '.join(allowed)} (got {params[name]!r})"
    return None


def check_constraints(text: str, specs: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """Return (number satisfied, one line per failed constraint naming it and why)."""
    satisfied, failures = 0, []
    for index, spec in enumerate(specs):
        params = {k: v for k, v in spec.items() if k != "type"}
        ok, why = CONSTRAINTS[spec["type"]].check(text, params)
        if ok:
            satisfied += 1
        else:
            failures.append(f"[{index}] {spec['type']}: {why}")
    return satisfied, failures
