"""Tool use: arithmetic and counting a tiny model cannot do in its head but can do with one Python call.

An opt-in group (``posttrain.tasks.problem.OPT_IN_GROUPS``): never part of the default selection or of the
``flywheel`` eval suite, chosen by name (``posttrain data tasks rl out.jsonl --group tool_use``), the data of the
``grpo_tools_tiny`` recipe (docs/agentic.md). Every answer is an integer checked by the ``numeric`` verifier
(tolerance 0), and each prompt states the computation exactly, so one ``<python>print(...)</python>`` call
answers it:

- tier 1 ``multiply_large``: a product of two 4-digit numbers (``print(4821 * 7390)``);
- tier 2 ``long_sum``: a sum of eight 3-digit numbers (``print(381 + 912 + ...)``);
- tier 3 ``count_letter``: how often a letter occurs in a 32-letter string (``print('abdc...'.count('b'))``).
"""

from __future__ import annotations

import random

from posttrain.tasks.problem import Problem, canonical_key, register_family
from posttrain.tasks.reasoning import NUMERIC, _off_by_a_little

GROUP = "tool_use"


def _numeric(family: str, tier: int, key: str, prompt: str, answer: int, statement: str) -> Problem:
    return Problem(family, GROUP, tier, key, prompt, str(answer), "numeric", dict(NUMERIC), statement)


@register_family("multiply_large", GROUP, 1, "What is 4821 * 7390? -> 35627190", _off_by_a_little)
def multiply_large(rng: random.Random) -> Problem:
    a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
    key = canonical_key("multiply_large", sorted((a, b)))
    return _numeric("multiply_large", 1, key, f"What is {a} * {b}?", a * b, f"{a} * {b} = {a * b}.")


@register_family("long_sum", GROUP, 2, "What is 381 + 912 + 275 + 640 + 118 + 953 + 407 + 726? -> 4412",
                 _off_by_a_little)
def long_sum(rng: random.Random) -> Problem:
    numbers = [rng.randint(100, 999) for _ in range(8)]
    key = canonical_key("long_sum", sorted(numbers))
    text = " + ".join(str(n) for n in numbers)
    return _numeric("long_sum", 2, key, f"What is {text}?", sum(numbers), f"{text} = {sum(numbers)}.")


@register_family("count_letter", GROUP, 3, "How many times does the letter b appear in abdcabbd...? -> 9",
                 _off_by_a_little)
def count_letter(rng: random.Random) -> Problem:
    letters = "abcd"
    text = "".join(rng.choice(letters) for _ in range(32))
    letter = rng.choice(letters)
    count = text.count(letter)
    key = canonical_key("count_letter", letter, text)
    return _numeric("count_letter", 3, key, f"How many times does the letter {letter} appear in {text}?", count,
                    f"The letter {letter} appears {count} times in {text}.")
