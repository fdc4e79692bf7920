"""Instruction following: answers must meet format constraints, checked by the ``ifeval`` verifier.

Each problem carries its constraints in ``options["constraints"]`` (types and fields as the eval
verifiers read them). The reference answer is one answer that meets them all; any other answer that
meets them scores the same. Tier 1 is one constraint on one word, tier 2 a layout (bullets, a fixed
prefix), tier 3 combined constraints (layout + case, required + forbidden words, JSON).
"""

from __future__ import annotations

import json
import random
from typing import Any

from posttrain.tasks.problem import Problem, canonical_key, register_family
from posttrain.tasks.words import COUNT_WORDS, JSON_KEYS, PREFIXES, WORDS, distinct_words, join_with_and

GROUP = "instruction_following"


def _problem(
    family: str,
    tier: int,
    key: str,
    prompt: str,
    answer: str,
    constraints: list[dict[str, Any]],
    statement: str,
) -> Problem:
    return Problem(
        family, GROUP, tier, key, prompt, answer, "ifeval", {"constraints": constraints}, statement
    )


def _bullets(words: list[str]) -> str:
    return "\n".join(f"- {w}" for w in words)


def _wrong_case(problem: Problem, rng: random.Random) -> str:
    # Same words, wrong case: fails the `case` constraint and nothing else.
    return problem.answer.lower() if problem.answer.isupper() else problem.answer.upper()


@register_family("upper", GROUP, 1, "Write the word dog in uppercase. -> DOG", _wrong_case)
def upper(rng: random.Random) -> Problem:
    word = rng.choice(WORDS)
    return _problem(
        "upper",
        1,
        canonical_key("upper", word),
        f"Write the word {word} in uppercase.",
        word.upper(),
        [
            {"type": "case", "value": "upper"},
            {"type": "required_keywords", "words": [word.upper()]},
            {"type": "max_words", "value": 1},
        ],
        f"The word {word} in uppercase is {word.upper()}.",
    )


@register_family("lower", GROUP, 1, "Write the word DOG in lowercase. -> dog", _wrong_case)
def lower(rng: random.Random) -> Problem:
    word = rng.choice(WORDS)
    return _problem(
        "lower",
        1,
        canonical_key("lower", word),
        f"Write the word {word.upper()} in lowercase.",
        word,
        [
            {"type": "case", "value": "lower"},
            {"type": "required_keywords", "words": [word]},
            {"type": "max_words", "value": 1},
        ],
        f"The word {word.upper()} in lowercase is {word}.",
    )


def _wrong_count(problem: Problem, rng: random.Random) -> str:
    words = problem.answer.split()
    return " ".join(words[:-1]) if len(words) > 2 and rng.random() < 0.5 else " ".join([*words, words[0]])


@register_family("repeat", GROUP, 1, "Write the word cat three times. -> cat cat cat", _wrong_count)
def repeat(rng: random.Random) -> Problem:
    word, times = rng.choice(WORDS), rng.choice(sorted(COUNT_WORDS))
    answer = " ".join([word] * times)
    return _problem(
        "repeat",
        1,
        canonical_key("repeat", word, times),
        f"Write the word {word} {COUNT_WORDS[times]} times.",
        answer,
        [
            {"type": "required_keywords", "words": [word]},
            {"type": "min_words", "value": times},
            {"type": "max_words", "value": times},
            {"type": "case", "value": "lower"},
        ],
        f"The word {word} {COUNT_WORDS[times]} times is {answer}.",
    )


def _not_bulleted(problem: Problem, rng: random.Random) -> str:
    words = [line.removeprefix("- ") for line in problem.answer.splitlines()]
    return ", ".join(words) if rng.random() < 0.5 else _bullets(words[:-1])


@register_family(
    "bullets", GROUP, 2, "List cat, dog and sun as bullet points. -> - cat\\n- dog\\n- sun", _not_bulleted
)
def bullets(rng: random.Random) -> Problem:
    words = distinct_words(rng, 3)
    return _problem(
        "bullets",
        2,
        canonical_key("bullets", sorted(words)),
        f"List {join_with_and(words)} as bullet points.",
        _bullets(words),
        [{"type": "bullet_count", "value": 3}, {"type": "required_keywords", "words": words}],
        f"A bullet list of {join_with_and(words)}:\n{_bullets(words)}",
    )


def _no_prefix(problem: Problem, rng: random.Random) -> str:
    prefix, word = problem.answer.split(" ", 1)
    other = rng.choice([p for p in PREFIXES if p != prefix])
    return word if rng.random() < 0.5 else f"{other} {word}"


@register_family(
    "prefix", GROUP, 2, "Begin with Answer: and then write the word cat. -> Answer: cat", _no_prefix
)
def prefix(rng: random.Random) -> Problem:
    word, start = rng.choice(WORDS), rng.choice(PREFIXES)
    return _problem(
        "prefix",
        2,
        canonical_key("prefix", start, word),
        f"Begin with {start} and then write the word {word}.",
        f"{start} {word}",
        [
            {"type": "starts_with", "text": start},
            {"type": "required_keywords", "words": [word]},
            {"type": "max_words", "value": 2},
        ],
        f"The word {word} after {start} reads {start} {word}.",
    )


@register_family(
    "bullets_upper",
    GROUP,
    3,
    "List cat, dog and sun as bullet points in uppercase. -> - CAT\\n- DOG\\n- SUN",
    _wrong_case,
)
def bullets_upper(rng: random.Random) -> Problem:
    words = distinct_words(rng, 3)
    loud = [w.upper() for w in words]
    return _problem(
        "bullets_upper",
        3,
        canonical_key("bullets_upper", sorted(words)),
        f"List {join_with_and(words)} as bullet points in uppercase.",
        _bullets(loud),
        [
            {"type": "bullet_count", "value": 3},
            {"type": "case", "value": "upper"},
            {"type": "required_keywords", "words": loud},
        ],
        f"A bullet list of {join_with_and(words)} in uppercase:\n{_bullets(loud)}",
    )


def _keeps_the_forbidden_word(problem: Problem, rng: random.Random) -> str:
    # Echo every listed word, the left-out one included.
    listed = problem.prompt.removeprefix("Write the words ").split(", but leave out ")[0]
    return listed.replace(",", "").replace(" and ", " ")


@register_family(
    "exclude",
    GROUP,
    3,
    "Write the words cat, dog, sun and map, but leave out dog. -> cat sun map",
    _keeps_the_forbidden_word,
)
def exclude(rng: random.Random) -> Problem:
    words = distinct_words(rng, 4)
    dropped = rng.choice(words)
    kept = [w for w in words if w != dropped]
    return _problem(
        "exclude",
        3,
        canonical_key("exclude", sorted(words), dropped),
        f"Write the words {join_with_and(words)}, but leave out {dropped}.",
        " ".join(kept),
        [
            {"type": "required_keywords", "words": kept},
            {"type": "forbidden_words", "words": [dropped]},
            {"type": "max_words", "value": 3},
        ],
        f"The words {join_with_and(words)} without {dropped} are {' '.join(kept)}.",
    )


def _not_json(problem: Problem, rng: random.Random) -> str:
    ((key, value),) = json.loads(problem.answer).items()
    return f"{key}: {value}"


@register_family(
    "json_pair",
    GROUP,
    3,
    'Write a JSON object with the key name and the value cat. -> {"name": "cat"}',
    _not_json,
)
def json_pair(rng: random.Random) -> Problem:
    key = rng.choice(JSON_KEYS)
    value = rng.choice([w for w in WORDS if w not in key and key not in w])
    answer = json.dumps({key: value})
    return _problem(
        "json_pair",
        3,
        canonical_key("json_pair", key, value),
        f"Write a JSON object with the key {key} and the value {value}.",
        answer,
        [{"type": "json"}, {"type": "required_keywords", "words": [key, value]}],
        f"A JSON object with the key {key} and the value {value} is {answer}.",
    )
