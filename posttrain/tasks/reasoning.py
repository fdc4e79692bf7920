"""Reasoning: multi-step arithmetic and comparisons, checked by the ``numeric`` verifier.

Tier 1 is one operation on two numbers, tier 2 two steps or a comparison, tier 3 an expression with
brackets, a short word problem, or a comparison of two sums. Answers are non-negative integers.
"""

from __future__ import annotations

import random

from posttrain.tasks.problem import Problem, canonical_key, register_family
from posttrain.tasks.words import NAMES, THINGS

GROUP = "reasoning"
NUMERIC = {"tolerance": 0}


def _off_by_a_little(problem: Problem, rng: random.Random) -> str:
    """A near miss: the kind of slip a model makes when it almost has the arithmetic right."""
    value = int(problem.answer)
    candidates = [value + d for d in (-3, -2, -1, 1, 2, 3, 10) if value + d >= 0]
    return str(rng.choice(candidates))


def numeric_problem(family: str, tier: int, key: str, prompt: str, answer: int, statement: str,
                    group: str = GROUP) -> Problem:
    """A problem whose answer is an integer, checked by the ``numeric`` verifier (``NUMERIC``); other groups whose
    answers are integers (``tool_use``) build theirs here too."""
    return Problem(family, group, tier, key, prompt, str(answer), "numeric", dict(NUMERIC), statement)


@register_family("add", GROUP, 1, "What is 7 + 5? -> 12", _off_by_a_little)
def add(rng: random.Random) -> Problem:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    key = canonical_key("add", sorted((a, b)))
    return numeric_problem("add", 1, key, f"What is {a} + {b}?", a + b, f"{a} + {b} = {a + b}.")


@register_family("subtract", GROUP, 1, "What is 9 - 4? -> 5", _off_by_a_little)
def subtract(rng: random.Random) -> Problem:
    a = rng.randint(1, 50)
    b = rng.randint(0, a)
    key = canonical_key("subtract", a, b)
    return numeric_problem("subtract", 1, key, f"What is {a} - {b}?", a - b, f"{a} - {b} = {a - b}.")


@register_family("add_subtract", GROUP, 2, "What is 7 + 5 - 3? -> 9", _off_by_a_little)
def add_subtract(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 30), rng.randint(1, 30)
    c = rng.randint(0, a + b)
    key = canonical_key("add_subtract", sorted((a, b)), c)
    value = a + b - c
    return numeric_problem("add_subtract", 2, key, f"What is {a} + {b} - {c}?", value, f"{a} + {b} - {c} = {value}.")


def _the_other_number(problem: Problem, rng: random.Random) -> str:
    # A comparison answered with the smaller number is the telling mistake; fall back to a near miss.
    numbers = [int(n) for n in problem.prompt.rstrip("?").replace(",", " ").split() if n.isdigit()]
    others = [n for n in numbers if str(n) != problem.answer]
    return str(others[0]) if others else _off_by_a_little(problem, rng)


@register_family("larger", GROUP, 2, "Which is larger, 47 or 74? -> 74", _the_other_number)
def larger(rng: random.Random) -> Problem:
    a, b = rng.sample(range(10, 100), 2)
    key = canonical_key("larger", sorted((a, b)))
    high, low = max(a, b), min(a, b)
    return numeric_problem("larger", 2, key, f"Which is larger, {a} or {b}?", high, f"{high} is larger than {low}.")


@register_family("expression", GROUP, 3, "What is (3 + 4) * 2 - 5? -> 9", _off_by_a_little)
def expression(rng: random.Random) -> Problem:
    inner_op, outer_op = rng.choice("+-"), rng.choice("+-")
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if inner_op == "-" and b > a:
        a, b = b, a
    c = rng.randint(2, 5)
    product = (a + b if inner_op == "+" else a - b) * c
    d = rng.randint(0, product) if outer_op == "-" else rng.randint(0, 20)
    value = product - d if outer_op == "-" else product + d
    inner_key = sorted((a, b)) if inner_op == "+" else [a, b]
    key = canonical_key("expression", inner_op, inner_key, c, outer_op, d)
    text = f"({a} {inner_op} {b}) * {c} {outer_op} {d}"
    return numeric_problem("expression", 3, key, f"What is {text}?", value, f"{text} = {value}.")


@register_family(
    "word_problem",
    GROUP,
    3,
    "Tom has 5 apples. Tom gets 3 more and gives away 2. How many apples does Tom have? -> 6",
    _off_by_a_little,
)
def word_problem(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 20), rng.randint(1, 20)
    c = rng.randint(0, a + b)
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    value = a + b - c
    # The key ignores the name and the objects: the same arithmetic in new clothes is the same problem.
    key = canonical_key("word_problem", a, b, c)
    prompt = (
        f"{name} has {a} {things}. {name} gets {b} more and gives away {c}. "
        f"How many {things} does {name} have?"
    )
    statement = f"{name} had {a} {things}, got {b} more and gave away {c}, so {name} has {value} {things}."
    return numeric_problem("word_problem", 3, key, prompt, value, statement)


def _the_smaller_sum(problem: Problem, rng: random.Random) -> str:
    left, right = problem.prompt.removeprefix("Which is larger, ").rstrip("?").split(" or ")
    sums = [sum(int(n) for n in side.split(" + ")) for side in (left, right)]
    return str(min(sums))


@register_family("larger_sum", GROUP, 3, "Which is larger, 12 + 5 or 9 + 7? -> 17", _the_smaller_sum)
def larger_sum(rng: random.Random) -> Problem:
    while True:
        a, b, c, d = (rng.randint(1, 30) for _ in range(4))
        if a + b != c + d:
            break
    pairs = sorted([sorted((a, b)), sorted((c, d))])
    key = canonical_key("larger_sum", pairs)
    left, right = f"{a} + {b} = {a + b}", f"{c} + {d} = {c + d}"
    high, low = (left, right) if a + b > c + d else (right, left)
    return numeric_problem(
        "larger_sum",
        3,
        key,
        f"Which is larger, {a} + {b} or {c} + {d}?",
        max(a + b, c + d),
        f"{high} is larger than {low}.",
    )
