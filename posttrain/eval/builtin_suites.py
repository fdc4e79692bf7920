"""A small built-in suite, ``smoke``: two or three items per verifier, for checking that evaluation works end
to end (CLI, sandbox, statistics). It measures nothing about a model; the real built-in suite is
``flywheel`` (posttrain.tasks).
"""

from __future__ import annotations

from posttrain.eval.items import Suite, register_suite


def _strict(call: str, expected: str) -> str:
    """A test line that checks the type as well as the value: ``==`` alone lets an object whose ``__eq__``
    always says yes pass (docs/security.md, "Writing tests")."""
    return f"got, want = {call}, {expected}\nassert type(got) is type(want) and got == want, (got, want)\n"

_ITEMS = [
    {"id": "smoke-add", "prompt": "What is 12 plus 30? Reply with the number only.", "verifier": "numeric",
     "answer": "42", "group": "reasoning", "tier": 1},
    {"id": "smoke-compare", "prompt": "Which is larger, 17 or 71? Reply with the number only.",
     "verifier": "numeric", "answer": "71", "group": "reasoning", "tier": 2},
    {"id": "smoke-half", "prompt": "What is one half of 7? Give a decimal.", "verifier": "numeric",
     "answer": "3.5", "options": {"tolerance": 0.01}, "group": "reasoning", "tier": 2},
    {"id": "smoke-choice", "prompt": "Which is a fruit? (A) dog (B) apple (C) car. Answer with the letter.",
     "verifier": "multiple_choice", "answer": "B", "group": "reasoning", "tier": 1},
    {"id": "smoke-reverse", "prompt": "Reverse the word hello.", "verifier": "exact", "answer": "olleh",
     "group": "transformation", "tier": 1},
    {"id": "smoke-upper", "prompt": "Write the word dog in uppercase.", "verifier": "exact", "answer": "DOG",
     "group": "transformation", "tier": 1},
    {"id": "smoke-fruit", "prompt": "Name three fruits.", "verifier": "contains", "answer": "apple",
     "group": "transformation", "tier": 1},
    {"id": "smoke-lower", "prompt": "Describe a cat in one short sentence, all in lowercase.", "verifier": "ifeval",
     "options": {"constraints": [{"type": "case", "value": "lower"}, {"type": "max_sentences", "value": 1}]},
     "group": "instruction_following", "tier": 1},
    {"id": "smoke-bullets", "prompt": "List two colors as bullet points starting with '- '.", "verifier": "ifeval",
     "options": {"constraints": [{"type": "bullet_count", "value": 2}, {"type": "max_words", "value": 10}]},
     "group": "instruction_following", "tier": 2},
    {"id": "smoke-json", "prompt": "Return a JSON object with a key \"name\" set to \"posttrain\".",
     "verifier": "ifeval", "options": {"constraints": [{"type": "json"}, {"type": "required_keywords",
                                                                          "words": ["posttrain"]}]},
     "group": "instruction_following", "tier": 3},
    {"id": "smoke-code-add", "prompt": "Write a Python function add(a, b) that returns a + b.", "verifier": "code",
     "tests": _strict("add(2, 3)", "5") + _strict("add(-1, 1)", "0"), "group": "code", "tier": 1},
    {"id": "smoke-code-rev", "prompt": "Write a Python function rev(s) that reverses a string.", "verifier": "code",
     "tests": _strict("rev('abc')", "'cba'") + _strict("rev('')", "''"), "group": "code", "tier": 2},
]


def smoke_suite() -> Suite:
    return Suite(
        name="smoke",
        items=[dict(item) for item in _ITEMS],
        group_weights={"reasoning": 1.0, "transformation": 1.0, "instruction_following": 1.0, "code": 1.0},
        description="Plumbing check: every verifier, a few items each.",
    )


register_suite("smoke", smoke_suite)
