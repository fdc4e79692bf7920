"""Tests call the solution across two processes; the test styles people write must keep working: plain
calls, HumanEval's ``check(candidate)``, classes and their methods, generators, in-place mutation,
callbacks, expected exceptions, the solution's constants and imports, unittest suites. And what cannot
cross fails loudly."""

from __future__ import annotations

import textwrap

import pytest

from posttrain.eval import sandbox
from posttrain.eval.sandbox import run_tests, sandbox_support

from .conftest import roomy_limits

SUPPORTED, WHY = sandbox_support()
LIMITS = roomy_limits()

SOLUTION = textwrap.dedent("""
    import math
    LIMIT = 10 ** 30
    class Invalid(ValueError):
        pass
    class Stack:
        def __init__(self):
            self.items = []
        def push(self, value):
            self.items.append(value)
            return self
        def pop(self):
            if not self.items:
                raise IndexError("pop from an empty stack")
            return self.items.pop()
        def __len__(self):
            return len(self.items)
    class Node:
        def __init__(self, value, next=None):
            self.value, self.next = value, next
    def add(a, b):
        return a + b
    def hypot(a, b):
        return math.sqrt(a * a + b * b)
    def sort_in_place(values):
        values.sort()
    def count_up(n):
        yield from range(n)
    def apply(function, values, key=None):
        return sorted((function(v) for v in values), key=key)
    def parse(text):
        if not text.isdigit():
            raise Invalid(f"not a number: {text!r}")
        return int(text)
    def shapes():
        return {"tuple": (1, 2), "set": {3}, "frozen": frozenset({4}), "bytes": b"\\x00\\xff", "nan": float("nan"),
                "complex": 1 + 2j, "nested": [[1, {"k": (None, True)}]], "big": 2 ** 200}
    def reverse_list(head):
        previous = None
        while head is not None:
            head.next, previous, head = previous, head, head.next
        return previous
""")

TESTS = textwrap.dedent("""
    import math
    assert add(2, 3) == 5 and type(add(2, 3)) is int
    def check(candidate):
        assert candidate("ab", "c") == "abc"
    check(add)
    assert math.isclose(hypot(3, 4), 5.0)
    assert LIMIT == 10 ** 30
    stack = Stack().push(1).push(2)
    assert len(stack) == 2 and stack.pop() == 2 and stack.items == [1]
    try:
        Stack().pop()
        raise AssertionError("expected IndexError")
    except IndexError as exc:
        assert "empty" in str(exc)
    try:
        parse("x")
        raise AssertionError("expected a ValueError")
    except ValueError:
        pass
    values = [3, 1, 2]
    sort_in_place(values)
    assert values == [1, 2, 3]
    assert list(count_up(4)) == [0, 1, 2, 3]
    generator = count_up(2)
    assert next(generator) == 0 and next(generator) == 1
    assert apply(lambda v: v * 10, [1, 2, 3], key=lambda v: -v) == [30, 20, 10]
    got = shapes()
    assert got["tuple"] == (1, 2) and type(got["tuple"]) is tuple and got["set"] == {3}
    assert got["frozen"] == frozenset({4}) and got["bytes"] == b"\\x00\\xff" and math.isnan(got["nan"])
    assert got["complex"] == 1 + 2j and got["nested"] == [[1, {"k": (None, True)}]] and got["big"] == 2 ** 200
    head = reverse_list(Node(1, Node(2, Node(3))))
    seen = []
    while head is not None:
        seen.append(head.value)
        head = head.next
    assert seen == [3, 2, 1]
""")


@pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
def test_common_test_styles_pass_against_a_correct_solution():
    result = run_tests(SOLUTION, TESTS, LIMITS)
    assert result.ok, (result.failure, result.stderr[-2000:])


UNITTEST_TESTS = textwrap.dedent("""
    import dataclasses
    import unittest

    seen = []

    def setUpModule():
        seen.append("module")

    @dataclasses.dataclass
    class Case:
        a: "int"
        b: "int"
        want: "int"

    class TestStack(unittest.TestCase):
        @classmethod
        def setUpClass(cls):
            cls.start = add(1, 1)

        def setUp(self):
            self.stack = Stack().push(self.start)

        def test_fixtures_ran(self):
            self.assertEqual(seen, ["module"])
            self.assertEqual(self.stack.pop(), 2)

        def test_errors(self):
            with self.assertRaises(IndexError):
                Stack().pop()
            with self.assertRaisesRegex(ValueError, "not a number"):
                parse("x")

        def test_cases(self):
            for case in [Case(1, 2, 3), Case(-1, 1, 0)]:
                with self.subTest(case=case):
                    self.assertEqual(add(case.a, case.b), case.want)

    class TestMath(unittest.TestCase):
        def test_hypot(self):
            self.assertAlmostEqual(hypot(3, 4), 5.0)
            self.assertIsInstance(LIMIT, int)

    if __name__ == "__main__":
        unittest.main(verbosity=2)
""")


@pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
def test_unittest_suites_run_in_the_test_process():
    """TestCase classes with module and class fixtures, subTests and assertRaises, ended by ``unittest.main``:
    the harness runs them (``setUpModule`` is found through ``sys.modules["__main__"]``), and a broken
    fixture fails the item."""
    result = run_tests(SOLUTION, UNITTEST_TESTS, LIMITS)
    assert result.ok, (result.failure, result.stderr[-2000:])
    broken = run_tests(SOLUTION, UNITTEST_TESTS.replace('seen.append("module")', "parse('y')"), LIMITS)
    assert broken.status == "error" and "setUpModule" in broken.failure, broken.failure


@pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
def test_each_failure_says_why_and_where():
    cases = {
        "assert add(2, 2) == 5\n": "AssertionError (line 1 of the tests)",
        "x = 1\nassert missing(1) == 1\n": "NameError: name 'missing' is not defined (line 2 of the tests)",
        "class Mine:\n    pass\nadd(Mine(), 1)\n": "TypeError: tests can pass data, solution objects and functions",
        "assert parse('x') == 1\n": "ValueError: Invalid: not a number: 'x' (line 1 of the tests)",
        "def broken(:\n": "the tests do not compile",
    }
    for tests, expected in cases.items():
        result = run_tests(SOLUTION, tests, LIMITS)
        assert result.status == "error" and expected in result.failure, (tests, result.failure)
    loading = run_tests("raise ValueError('no')", "assert True\n", LIMITS)
    assert loading.status == "error" and loading.failure == "the solution raised ValueError while loading: no"


def test_unsandboxed_runs_keep_the_two_processes(monkeypatch):
    """Without the jail (allowed explicitly), the tests still run apart from the solution."""
    monkeypatch.setattr(sandbox, "sandbox_support", lambda: (False, "no jail in this test"))
    result = run_tests("import os\nos._exit(0)", "assert add(1, 1) == 2\n", LIMITS, allow_unsandboxed=True)
    assert not result.ok and "before the tests finished" in result.failure
    good = run_tests(SOLUTION, TESTS, LIMITS, allow_unsandboxed=True)
    assert good.ok and not good.isolated, good.failure
