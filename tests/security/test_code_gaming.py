"""Gaming the code verifier through the tests' own machinery: unittest suites and the stdlib modules the
solution names.

- unittest: ``unittest.main(argv=[...], exit=False)`` reported a wrong solution's failures and let the tests
  reach their end, which scored 1.0; plain ``unittest.main()`` ran against the test process's ``sys.argv``
  and exited, which scored a correct solution 0; TestCase classes without ``unittest.main`` never ran at all
  (a pass for anything). The harness now runs the tests' TestCases itself and reads the TestResult.
- modules: the test process imports a stdlib module a solution's name refers to when the tests use that name,
  and the solution chooses the module's name (``types.ModuleType("venv.__main__")``). The check looked at the
  top package only, so the trusted process ran ``unittest.__main__`` or ``venv.__main__`` on import.

Each case goes through the verifier (``verify``), the way a reward does, except the table of module names.
"""

from __future__ import annotations

import textwrap

import pytest

from posttrain.eval.items import EvalItem
from posttrain.eval.sandbox import sandbox_support
from posttrain.eval.sandbox_runner import _importable
from posttrain.eval.verifiers import VerifySettings, verify
from tests.eval.conftest import roomy_limits

SUPPORTED, WHY = sandbox_support()
needs_sandbox = pytest.mark.skipif(not SUPPORTED, reason=f"sandbox unavailable here: {WHY}")
SETTINGS = VerifySettings(code_limits=roomy_limits())
RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
TEST_CASE = textwrap.dedent("""
    import unittest

    class TestAdd(unittest.TestCase):
        def test_small(self):
            self.assertEqual(add(2, 3), 5)

        def test_negative(self):
            self.assertEqual(add(-1, 1), 0)
""")
# Every way of calling unittest.main seen in test files; none may decide the verdict by itself.
MAIN_CALLS = {
    "exit=False": "unittest.main(argv=['x'], exit=False)\n",
    "plain, under __main__": "if __name__ == '__main__':\n    unittest.main()\n",
    "plain": "unittest.main()\n",
    "verbosity and exit=True": "unittest.main(verbosity=2, exit=True)\n",
    "argv naming no test": "unittest.main(argv=['prog', 'NoSuchTest'], exit=False)\n",
    "result read back": "program = unittest.main(exit=False)\nassert program.result.testsRun == 2\n",
    "TestProgram": "unittest.TestProgram(exit=False)\n",
    "from unittest import main": "from unittest import main\nmain()\n",
}


def item(tests: str) -> EvalItem:
    return EvalItem(id="add", prompt="write add", verifier="code", group="code", tests=tests)


@needs_sandbox
@pytest.mark.parametrize("call", sorted(MAIN_CALLS))
def test_unittest_main_never_decides_the_verdict(call):
    """``exit=False`` used to pass a wrong solution; a plain ``unittest.main()`` used to fail a right one."""
    tests = item(TEST_CASE + MAIN_CALLS[call])
    wrong = verify(tests, WRONG, SETTINGS)
    assert not wrong.passed and wrong.score == 0.0, (call, wrong.detail)
    assert "unittest tests ran, not all passed" in wrong.detail, wrong.detail
    assert "AssertionError" in wrong.detail, wrong.detail
    right = verify(tests, RIGHT, SETTINGS)
    assert right.passed and right.score == 1.0, (call, right.detail)


@needs_sandbox
def test_test_case_classes_without_unittest_main_are_run():
    """A file of TestCase classes and nothing else used to pass any solution: the classes were never run."""
    tests = item(TEST_CASE)
    wrong = verify(tests, WRONG, SETTINGS)
    assert not wrong.passed and "2 unittest tests ran, not all passed" in wrong.detail, wrong.detail
    assert verify(tests, RIGHT, SETTINGS).passed


@needs_sandbox
def test_the_failure_names_the_test_and_the_line():
    result = verify(item(TEST_CASE), "def add(a, b):\n    return 5\n", SETTINGS)
    expected = "TestAdd.test_negative: AssertionError: 5 != 0 (line 9 of the tests)"
    assert expected in result.detail, result.detail


SKIPS_AND_EMPTY = {
    "every test skipped": "import unittest\nclass T(unittest.TestCase):\n    @unittest.skip('later')\n"
                          "    def test_add(self):\n        assert add(2, 3) == 5\n",
    "one test skipped": TEST_CASE + "    @unittest.skip('later')\n    def test_big(self):\n"
                                    "        self.assertEqual(add(10, 20), 30)\n",
    "skip decided by the solution": "import unittest\nclass T(unittest.TestCase):\n"
                                    "    @unittest.skipUnless(add(0, 0) == 0, 'no add')\n"
                                    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n",
    "skipTest in the test": "import unittest\nclass T(unittest.TestCase):\n    def test_add(self):\n"
                            "        if add(2, 3) != 5:\n            self.skipTest('odd')\n",
    "expected failure": "import unittest\nclass T(unittest.TestCase):\n    @unittest.expectedFailure\n"
                        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n",
    "main() and no TestCase": "import unittest\nunittest.main()\n",
    "a TestCase with no tests": "import unittest\nclass T(unittest.TestCase):\n    pass\nunittest.main()\n",
}


@needs_sandbox
@pytest.mark.parametrize("name", sorted(SKIPS_AND_EMPTY))
def test_a_skipped_or_empty_suite_is_not_a_pass(name):
    """A skipped test checked nothing (and a skip condition can ask the solution), so the wrong solution
    here must not pass; a suite that ran no test is no pass either."""
    result = verify(item(SKIPS_AND_EMPTY[name]), WRONG, SETTINGS)
    assert not result.passed and result.score == 0.0, (name, result.detail)


SOLUTION_TRICKS = {
    "raises SkipTest": "import unittest\ndef add(a, b):\n    raise unittest.SkipTest('not today')\n",
    "raises SystemExit(0)": "def add(a, b):\n    raise SystemExit(0)\n",
    "exits 0 inside the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "runs unittest.main itself": "import unittest\nunittest.main(argv=['x'], exit=False)\n" + WRONG,
    "defines load_tests and a TestAdd": WRONG + "def load_tests(*args):\n    return None\nTestAdd = None\n",
    "returns an always-equal object": "class Yes:\n    def __eq__(self, other):\n        return True\n"
                                      "def add(a, b):\n    return Yes()\n",
}


@needs_sandbox
@pytest.mark.parametrize("name", sorted(SOLUTION_TRICKS))
def test_the_solution_cannot_make_a_failing_test_case_pass(name):
    tests = item(TEST_CASE + MAIN_CALLS["exit=False"])
    result = verify(tests, SOLUTION_TRICKS[name], SETTINGS)
    assert not result.passed and result.score == 0.0, (name, result.detail)


FAKE_UNITTEST = textwrap.dedent("""
    class FakeUnittest:
        class TestCase:
            pass
        def main(self, *args, **kwargs):
            return None
    unittest = FakeUnittest()
""") + WRONG


@needs_sandbox
def test_the_solution_cannot_supply_the_tests_unittest():
    """Tests that use ``unittest`` without importing it (written for a harness that ran them after the
    solution) get the real module, not the solution's object with a do-nothing TestCase and main."""
    tests = item(TEST_CASE.replace("import unittest\n", "") + "unittest.main()\n")
    result = verify(tests, FAKE_UNITTEST, SETTINGS)
    assert not result.passed and "AssertionError" in result.detail, result.detail


@needs_sandbox
def test_a_failing_plain_assert_still_fails_a_passing_suite():
    result = verify(item(TEST_CASE + "assert add(2, 2) == 5\n"), RIGHT, SETTINGS)
    assert not result.passed and "AssertionError" in result.detail, result.detail


# --- the solution's module names -------------------------------------------------------------------------

FAKE_MODULES = ["unittest.__main__", "venv.__main__", "unittest.test", "json.__init__"]


@needs_sandbox
@pytest.mark.parametrize("module", FAKE_MODULES)
def test_a_solution_cannot_make_the_test_process_import_a_program(module):
    """``helper`` is a module named ``module`` in the solution; the tests name ``helper`` (so the old check
    imported ``module`` here: ``unittest.__main__`` ran a test program and exited, ``venv.__main__`` built a
    venv and exited, ``unittest.test`` loaded unittest's own suite). Now nothing is imported and the tests,
    which need nothing from it, pass."""
    solution = f"import types\nhelper = types.ModuleType({module!r})\n" + RIGHT
    tests = textwrap.dedent(f"""
        import sys
        assert add(2, 3) == 5
        try:
            helper
        except NameError:
            pass
        assert {module!r} not in sys.modules, "the test process imported " + {module!r}
    """)
    result = verify(item(tests), solution, SETTINGS)
    assert result.passed, (module, result.detail)


@pytest.mark.parametrize(("module", "importable"), [
    ("math", True), ("collections.abc", True), ("xml.etree.ElementTree", True), ("os", True),
    ("unittest.__main__", False), ("venv.__main__", False), ("asyncio.__main__", False),
    ("json.__main__.x", False), ("__phello__.spam", False), ("__main__", False), ("_thread", False),
    ("json._private", False), ("idlelib.idle", False), ("unittest.test", False), ("ctypes.test.x", False),
    ("lib2to3.tests", False), ("this", False), ("numpy", False), ("", False), ("os..path", False),
    ("os.path ", False), ("json.dé", False), ("json.1x", False), (None, False), (["json"], False),
])
def test_only_a_plain_public_stdlib_module_is_imported_for_the_solution(module, importable):
    assert _importable(module) is importable
