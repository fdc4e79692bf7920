"""Transformation: string and list manipulation, checked by the ``exact`` verifier (``ifeval`` where case matters).

Tier 1 reads one word (reverse it, name its first or last letter), tier 2 reorders a short list (sort
numbers, reverse a list of words), tier 3 chains two operations (reverse then uppercase, sort words,
pick the first letter of each word, sort numbers from largest to smallest).
"""

from __future__ import annotations

import random

from posttrain.tasks.problem import Problem, canonical_key, register_family
from posttrain.tasks.words import WORDS, distinct_words

GROUP = "transformation"


def _exact(family: str, tier: int, key: str, prompt: str, answer: str, statement: str) -> Problem:
    return Problem(family, GROUP, tier, key, prompt, answer, "exact", {}, statement)


def _swap_two(problem: Problem, rng: random.Random) -> str:
    """Swap two different neighbouring items (letters of one word, or items of a list)."""
    spaced = " " in problem.answer
    items = problem.answer.split() if spaced else list(problem.answer)
    positions = [i for i in range(len(items) - 1) if items[i] != items[i + 1]]
    if not positions:  # nothing to swap: change one letter instead
        return problem.answer[:-1] + ("z" if problem.answer[-1] != "z" else "y")
    i = rng.choice(positions)
    items[i], items[i + 1] = items[i + 1], items[i]
    return " ".join(items) if spaced else "".join(items)


def _unreversed(problem: Problem, rng: random.Random) -> str:
    # Echoing the input unchanged is the commonest failure on "reverse"; words here are never palindromes.
    return problem.answer[::-1] if rng.random() < 0.5 else _swap_two(problem, rng)


@register_family("reverse_word", GROUP, 1, "Reverse the word cat. -> tac", _unreversed)
def reverse_word(rng: random.Random) -> Problem:
    word = rng.choice(WORDS)
    return _exact(
        "reverse_word",
        1,
        canonical_key("reverse_word", word),
        f"Reverse the word {word}.",
        word[::-1],
        f"The word {word} reversed is {word[::-1]}.",
    )


def _another_letter(problem: Problem, rng: random.Random) -> str:
    return rng.choice([c for c in "abcdefghijklmnopqrstuvwxyz" if c != problem.answer])


@register_family("first_letter", GROUP, 1, "What is the first letter of cat? -> c", _another_letter)
def first_letter(rng: random.Random) -> Problem:
    word = rng.choice(WORDS)
    return _exact(
        "first_letter",
        1,
        canonical_key("first_letter", word),
        f"What is the first letter of {word}?",
        word[0],
        f"The first letter of {word} is {word[0]}.",
    )


@register_family("last_letter", GROUP, 1, "What is the last letter of cat? -> t", _another_letter)
def last_letter(rng: random.Random) -> Problem:
    word = rng.choice(WORDS)
    return _exact(
        "last_letter",
        1,
        canonical_key("last_letter", word),
        f"What is the last letter of {word}?",
        word[-1],
        f"The last letter of {word} is {word[-1]}.",
    )


@register_family("sort_numbers", GROUP, 2, "Sort these numbers: 5 2 9 -> 2 5 9", _swap_two)
def sort_numbers(rng: random.Random) -> Problem:
    numbers = rng.sample(range(1, 50), 3)
    ordered = " ".join(str(n) for n in sorted(numbers))
    shown = " ".join(str(n) for n in numbers)
    return _exact(
        "sort_numbers",
        2,
        canonical_key("sort_numbers", sorted(numbers)),
        f"Sort these numbers: {shown}",
        ordered,
        f"The numbers {shown} in order are {ordered}.",
    )


def _list_unreversed(problem: Problem, rng: random.Random) -> str:
    items = problem.answer.split()
    return " ".join(items[::-1]) if rng.random() < 0.5 else _swap_two(problem, rng)


@register_family("reverse_list", GROUP, 2, "Reverse the list: cat dog sun -> sun dog cat", _list_unreversed)
def reverse_list(rng: random.Random) -> Problem:
    words = distinct_words(rng, 3)
    shown, answer = " ".join(words), " ".join(reversed(words))
    return _exact(
        "reverse_list",
        2,
        canonical_key("reverse_list", words),
        f"Reverse the list: {shown}",
        answer,
        f"The list {shown} reversed is {answer}.",
    )


def _half_done(problem: Problem, rng: random.Random) -> str:
    # Did one of the two steps only: reversed but lowercase, or uppercase but not reversed.
    return problem.answer.lower() if rng.random() < 0.5 else problem.answer[::-1]


@register_family(
    "reverse_upper",
    GROUP,
    3,
    "Reverse the word cat and write it in uppercase. -> TAC",
    _half_done,
)
def reverse_upper(rng: random.Random) -> Problem:
    word = rng.choice(WORDS)
    answer = word[::-1].upper()
    # `exact` compares case-insensitively and would accept "tac"; these three constraints accept
    # exactly the one uppercase word (any surrounding punctuation aside).
    constraints = [
        {"type": "case", "value": "upper"},
        {"type": "required_keywords", "words": [answer]},
        {"type": "max_words", "value": 1},
    ]
    return Problem(
        "reverse_upper",
        GROUP,
        3,
        canonical_key("reverse_upper", word),
        f"Reverse the word {word} and write it in uppercase.",
        answer,
        "ifeval",
        {"constraints": constraints},
        f"The word {word} reversed in uppercase is {answer}.",
    )


@register_family("sort_words", GROUP, 3, "Sort these words: pear cat dog -> cat dog pear", _swap_two)
def sort_words(rng: random.Random) -> Problem:
    words = distinct_words(rng, 3)
    shown, answer = " ".join(words), " ".join(sorted(words))
    return _exact(
        "sort_words",
        3,
        canonical_key("sort_words", sorted(words)),
        f"Sort these words: {shown}",
        answer,
        f"The words {shown} in order are {answer}.",
    )


@register_family(
    "first_letters",
    GROUP,
    3,
    "Write the first letter of each word: cat dog sun -> c d s",
    _swap_two,
)
def first_letters(rng: random.Random) -> Problem:
    while True:
        words = distinct_words(rng, 3)
        if len({w[0] for w in words}) > 1:  # all the same letter leaves nothing to get wrong by order
            break
    shown, answer = " ".join(words), " ".join(w[0] for w in words)
    return _exact(
        "first_letters",
        3,
        canonical_key("first_letters", words),
        f"Write the first letter of each word: {shown}",
        answer,
        f"The first letters of {shown} are {answer}.",
    )


@register_family(
    "sort_descending",
    GROUP,
    3,
    "Sort these numbers from largest to smallest: 5 2 9 7 -> 9 7 5 2",
    _swap_two,
)
def sort_descending(rng: random.Random) -> Problem:
    numbers = rng.sample(range(1, 50), 4)
    ordered = " ".join(str(n) for n in sorted(numbers, reverse=True))
    shown = " ".join(str(n) for n in numbers)
    return _exact(
        "sort_descending",
        3,
        canonical_key("sort_descending", sorted(numbers)),
        f"Sort these numbers from largest to smallest: {shown}",
        ordered,
        f"The numbers {shown} from largest to smallest are {ordered}.",
    )
