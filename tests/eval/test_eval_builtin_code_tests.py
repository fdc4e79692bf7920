"""The built-in suites' code tests check types and values, so an object that claims to equal anything (or an
int/str subclass that does) fails every built-in code item instead of passing it."""

from __future__ import annotations

import builtins

import pytest

from posttrain.eval.items import SUITES, _load_builtin_suites, load_suite
from posttrain.eval.sandbox import sandbox_support
from posttrain.eval.verifiers import VerifySettings, verify

from .conftest import roomy_limits

SUPPORTED, WHY = sandbox_support()
SETTINGS = VerifySettings(code_limits=roomy_limits(),
                          allow_unsandboxed_code=not SUPPORTED)

LIARS = {
    "always-equal object": """
class Liar:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __lt__ = __le__ = __gt__ = __ge__ = __eq__
    def __hash__(self): return 0
    def __bool__(self): return True
    def __len__(self): return 0
    def __iter__(self): return iter(())
    def __getattr__(self, name): return self
    def __call__(self, *args, **kwargs): return self
""",
    "int subclass that equals anything": """
class Liar(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__
""",
    "str subclass that equals anything": """
class Liar(str):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = str.__hash__
""",
}


def _builtin_code_items():
    _load_builtin_suites()
    return [(name, item) for name in sorted(SUITES) for item in load_suite(name).items if item.verifier == "code"]


def _names_the_tests_call(tests: str) -> set[str]:
    names, stack = set(), [compile(tests, "<tests>", "exec")]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(const for const in code.co_consts if hasattr(const, "co_names"))
    return {name for name in names if not hasattr(builtins, name)}


def test_there_are_built_in_code_items():
    assert len(_builtin_code_items()) >= 2


def _liar_solution(liar: str, tests: str) -> str:
    return LIARS[liar] + "\n".join(f"def {name}(*args, **kwargs):\n    return Liar()"
                                   for name in sorted(_names_the_tests_call(tests)))


@pytest.mark.parametrize("liar", sorted(LIARS))
def test_the_built_in_tests_reject_a_liar_even_in_its_own_process(liar):
    """The tests' own checks, without the sandbox's channel: run in one namespace with the liar, as a
    user's harness (or the unsandboxed path of another tool) would."""
    for suite, item in _builtin_code_items():
        namespace: dict = {}
        exec(_liar_solution(liar, item.tests), namespace)
        try:
            exec(item.tests, namespace)
        except AssertionError:
            continue
        pytest.fail(f"{suite}/{item.id}: the {liar} passed the tests")


@pytest.mark.parametrize("liar", sorted(LIARS))
def test_a_lying_object_fails_every_built_in_code_item(liar):
    for suite, item in _builtin_code_items():
        result = verify(item, _liar_solution(liar, item.tests), SETTINGS)
        assert not result.passed, (suite, item.id, liar, result.detail)
