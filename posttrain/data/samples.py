"""A small built-in SFT dataset of checkable tasks (arithmetic, string manipulation), some multi-turn.

Used by ``make demo`` and the tests: no download, deterministic for a given seed, answers that are
correct by construction. Tiers follow the curriculum's meaning — 1 basic comprehension (copy, case,
compare), 2 logical application (arithmetic, sorting, reversing), 3 complex creation (multi-turn
chains that build on the previous answer). Every fourth record carries no tier, as real data often
does, so untiered handling is exercised too.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from posttrain.data.records import Message, SFTExample

_WORDS = ("apple", "banana", "cherry", "dog", "hello", "river", "stone", "garden", "planet", "window",
          "music", "orange", "purple", "silver", "tiger", "yellow")

Task = Callable[[random.Random], tuple[list[tuple[str, str]], int, str]]


def _uppercase(rng: random.Random) -> tuple[list[tuple[str, str]], int, str]:
    word = rng.choice(_WORDS)
    return [(f"Write the word {word} in capital letters.", word.upper())], 1, "uppercase"


def _larger(rng: random.Random) -> tuple[list[tuple[str, str]], int, str]:
    a, b = rng.sample(range(1, 100), 2)
    return [(f"Which number is larger, {a} or {b}?", str(max(a, b)))], 1, "compare"


def _count_letters(rng: random.Random) -> tuple[list[tuple[str, str]], int, str]:
    word = rng.choice(_WORDS)
    return [(f"How many letters are in the word {word}?", str(len(word)))], 1, "count_letters"


def _add(rng: random.Random) -> tuple[list[tuple[str, str]], int, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return [(f"What is {a} plus {b}?", f"{a} + {b} = {a + b}. The answer is {a + b}.")], 2, "add"


def _multiply(rng: random.Random) -> tuple[list[tuple[str, str]], int, str]:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return [(f"What is {a} times {b}?", f"{a} x {b} = {a * b}. The answer is {a * b}.")], 2, "multiply"


def _reverse(rng: random.Random) -> tuple[list[tuple[str, str]], int, str]:
    word = rng.choice(_WORDS)
    return [(f"Reverse the word {word}.", word[::-1])], 2, "reverse"


def _sort(rng: random.Random) -> tuple[list[tuple[str, str]], int, str]:
    numbers = rng.sample(range(1, 50), rng.randint(3, 5))
    shown, ordered = ", ".join(map(str, numbers)), ", ".join(map(str, sorted(numbers)))
    return [(f"Sort these numbers from smallest to largest: {shown}.", ordered)], 2, "sort"


def _chain_arithmetic(rng: random.Random) -> tuple[list[tuple[str, str]], int, str]:
    a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 5)
    total = a + b
    return [
        (f"What is {a} plus {b}?", f"{a} + {b} = {total}. The answer is {total}."),
        (f"Now multiply that by {c}.", f"{total} x {c} = {total * c}. The answer is {total * c}."),
        ("Is the result even or odd?", "even" if total * c % 2 == 0 else "odd"),
    ], 3, "chain_arithmetic"


def _chain_words(rng: random.Random) -> tuple[list[tuple[str, str]], int, str]:
    first, second = rng.sample(_WORDS, 2)
    joined = f"{first} {second}"
    return [
        (f"Join the words {first} and {second} with a space.", joined),
        ("Reverse that text.", joined[::-1]),
    ], 3, "chain_words"


_TASKS: tuple[Task, ...] = (_uppercase, _larger, _count_letters, _add, _multiply, _reverse, _sort,
                            _chain_arithmetic, _chain_words)


def sample_sft_records(n: int = 64, seed: int = 0) -> list[SFTExample]:
    """``n`` deterministic chat examples cycling through the built-in tasks (about a third multi-turn)."""
    rng = random.Random(seed)
    records = []
    for index in range(n):
        task = _TASKS[index % len(_TASKS)]
        turns, tier, name = task(rng)
        messages = [Message(role="system", content="You are a careful assistant. Answer briefly.")]
        for question, answer in turns:
            messages += [Message(role="user", content=question), Message(role="assistant", content=answer)]
        records.append(
            SFTExample(
                # Small tasks repeat (the same word twice), so ids come from the position, not the content.
                id=f"sample-{seed}-{index:05d}",
                messages=messages,
                tier=None if index % 4 == 3 else tier,
                difficulty=float(tier) + len(turns) / 10,
                meta={"task": name, "source": "posttrain.samples", "seed": seed},
            )
        )
    return records
