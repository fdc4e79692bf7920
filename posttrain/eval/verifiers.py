"""Verifiers: decide, by code, how well a model output answers an item. Shared by evaluation, rejection
sampling and RL rewards.

Each verifier is ``fn(output, item, settings) -> VerifyResult(score in [0, 1], passed, detail)`` registered
in ``VERIFIERS`` under its name (duplicates are refused). ``verify(item, output, settings)`` dispatches on
``item.verifier``. ``check_item(item)`` validates an item's options when a suite loads.

``settings`` (:class:`VerifySettings`: the code sandbox's limits and whether code may run unsandboxed) is
passed with every call and never kept in a global: an eval run, threaded reward workers and a web service
verify concurrently, each under its own limits.

Built in: ``exact``, ``numeric``, ``multiple_choice``, ``contains``, ``ifeval`` (posttrain.eval.ifeval) and
``code`` (runs in posttrain.eval.sandbox).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from posttrain.eval.ifeval import check_constraints, constraint_problem
from posttrain.eval.items import EvalItem, _Registry
from posttrain.eval.sandbox import SandboxLimits, printable_excerpt, run_tests


@dataclass
class VerifyResult:
    score: float
    passed: bool
    detail: str


@dataclass(frozen=True)
class VerifySettings:
    """How verifiers run, given with each call. Only the code verifier reads these today."""

    code_limits: SandboxLimits = field(default_factory=SandboxLimits)  # per run; an item's options override
    allow_unsandboxed_code: bool = False  # run code even where the sandbox cannot isolate it


DEFAULT_SETTINGS = VerifySettings()

Verifier = Callable[[str, EvalItem, VerifySettings], VerifyResult]
VERIFIERS: dict[str, Verifier] = _Registry("verifier")
# Optional per-verifier option checks: fn(item) -> (field, reason) | None, run when a suite loads.
OPTION_CHECKS: dict[str, Callable[[EvalItem], tuple[str, str] | None]] = _Registry("option check")


def register_verifier(name: str, check: Callable[[EvalItem], tuple[str, str] | None] | None = None):
    def decorate(fn: Verifier) -> Verifier:
        VERIFIERS[name] = fn
        if check is not None:
            OPTION_CHECKS[name] = check
        return fn

    return decorate


def verify(item: EvalItem, output: str, settings: VerifySettings = DEFAULT_SETTINGS) -> VerifyResult:
    """Score ``output`` for ``item`` with its verifier, under ``settings`` (default: sandboxed code, default limits)."""
    if item.verifier not in VERIFIERS:
        raise KeyError(f"item {item.id!r}: unknown verifier {item.verifier!r}; known: {', '.join(VERIFIERS)}")
    return VERIFIERS[item.verifier](output, item, settings)


def check_item(item: EvalItem) -> tuple[str, str] | None:
    """(field, reason) when the item cannot be verified as written, else None."""
    if item.verifier not in VERIFIERS:
        import difflib

        guess = difflib.get_close_matches(item.verifier, list(VERIFIERS), n=1)
        hint = f"did you mean `{guess[0]}`?" if guess else f"known: {', '.join(VERIFIERS)}"
        return "verifier", f"unknown verifier {item.verifier!r}; {hint}"
    check = OPTION_CHECKS.get(item.verifier)
    return check(item) if check else None


def _needs_answer(item: EvalItem) -> tuple[str, str] | None:
    if item.answer is None or not str(item.answer).strip():
        return "answer", f"the {item.verifier} verifier needs an expected `answer`"
    return None


def _only_options(item: EvalItem, allowed: set[str]) -> tuple[str, str] | None:
    unknown = sorted(set(item.options) - allowed)
    if unknown:
        return f"options.{unknown[0]}", f"unknown option for {item.verifier}; takes: {', '.join(sorted(allowed)) or 'none'}"
    return None


# --- exact / contains -------------------------------------------------------------------------------


def normalize(text: str) -> str:
    """strip, casefold, collapse whitespace, drop trailing periods: "  The  Answer. " -> "the answer"."""
    text = " ".join(text.strip().casefold().split())
    return text.rstrip(".").rstrip()


def _check_plain(item: EvalItem):
    return _needs_answer(item) or _only_options(item, set())


@register_verifier("exact", _check_plain)
def exact(output: str, item: EvalItem, settings: VerifySettings) -> VerifyResult:
    got, want = normalize(output), normalize(item.answer or "")
    if got == want:
        return VerifyResult(1.0, True, "exact match")
    return VerifyResult(0.0, False, f"expected {want!r}, got {got[:200]!r}")


@register_verifier("contains", _check_plain)
def contains(output: str, item: EvalItem, settings: VerifySettings) -> VerifyResult:
    want = normalize(item.answer or "")
    if want in normalize(output):
        return VerifyResult(1.0, True, f"contains {want!r}")
    return VerifyResult(0.0, False, f"does not contain {want!r}")


# --- numeric ------------------------------------------------------------------------------------------

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+"
NUMBER_RE = re.compile(rf"(?<![\w.])(?P<num>{_NUMBER})(?:\s*/\s*(?P<den>{_NUMBER}))?")
ANSWER_MARKER = re.compile(r"answer\s*:", re.IGNORECASE)


def _to_float(text: str) -> float:
    return float(text.replace(",", ""))


def _match_value(match: re.Match) -> float:
    value = _to_float(match.group("num"))
    if match.group("den") is not None:
        denominator = _to_float(match.group("den"))
        if denominator == 0:
            raise ZeroDivisionError
        value = float(Fraction(str(value)) / Fraction(str(denominator)))
    return value


def extract_number(text: str) -> tuple[float, str] | None:
    """The number after the last "answer:" if there is one, else the last number in the text.

    Handles signs, decimals, exponents, thousands commas ("1,234") and simple fractions ("3/4").
    Returns (value, the matched text) or None.
    """
    text = text.replace("\u2212", "-")  # typographic minus
    markers = list(ANSWER_MARKER.finditer(text))
    if markers:
        match = NUMBER_RE.search(text, markers[-1].end())
        candidates = [match] if match else []
    else:
        candidates = list(NUMBER_RE.finditer(text))[-1:]
    for match in candidates:
        try:
            return _match_value(match), match.group(0)
        except (ValueError, ZeroDivisionError, OverflowError):
            return None
    return None


def parse_answer_number(answer: str) -> float:
    """An expected answer as a number: "42", "-3.5", "1,000", "3/4"."""
    text = answer.strip().replace("\u2212", "-")
    match = NUMBER_RE.fullmatch(text)
    if match:
        return _match_value(match)
    return float(text)


def _check_numeric(item: EvalItem):
    problem = _needs_answer(item) or _only_options(item, {"tolerance", "rel_tolerance"})
    if problem:
        return problem
    try:
        parse_answer_number(item.answer or "")
    except (ValueError, ZeroDivisionError):
        return "answer", f"numeric verifier: answer {item.answer!r} is not a number"
    for key in ("tolerance", "rel_tolerance"):
        value = item.options.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or value < 0):
            return f"options.{key}", f"must be a number >= 0 (got {value!r})"
    return None


@register_verifier("numeric", _check_numeric)
def numeric(output: str, item: EvalItem, settings: VerifySettings) -> VerifyResult:
    want = parse_answer_number(item.answer or "")
    found = extract_number(output)
    if found is None:
        return VerifyResult(0.0, False, "no number found in the output")
    got, text = found
    tolerance = float(item.options.get("tolerance", 1e-6))
    rel = item.options.get("rel_tolerance")
    close = math.isfinite(got) and (
        abs(got - want) <= tolerance or (rel is not None and abs(got - want) <= float(rel) * abs(want))
    )
    if close:
        return VerifyResult(1.0, True, f"{text} matches {item.answer}")
    return VerifyResult(0.0, False, f"expected {item.answer}, got {text}")


# --- multiple choice ----------------------------------------------------------------------------------

_MC_ANSWER = re.compile(r"(?i:answer)\s*(?:(?i:is)|:)?\s*:?\s*\(?([A-E])(?![\w'])")
_MC_PAREN = re.compile(r"\(([A-E])\)")
_MC_LINE_START = re.compile(r"^\s*([A-E])[).:]", re.MULTILINE)
_MC_LONE = re.compile(r"(?<![\w'])([A-E])(?![\w'])")


def extract_choice(text: str) -> str | None:
    """A choice letter A-E, by order of evidence: the whole output is a letter; "answer: B" / "answer is (B)"
    (last one); "(B)"; "B)" or "B." at a line start; a lone capital letter. The article "A" (followed by a
    lowercase word) is not a choice.
    """
    stripped = text.strip().strip(".()").strip()
    if re.fullmatch(r"[A-Ea-e]", stripped):
        return stripped.upper()
    answers = list(_MC_ANSWER.finditer(text))
    if answers:
        return answers[-1].group(1)
    for pattern in (_MC_PAREN, _MC_LINE_START):
        match = pattern.search(text)
        if match:
            return match.group(1)
    for match in _MC_LONE.finditer(text):
        if match.group(1) == "A" and re.match(r"\s+[a-z]", text[match.end():]):
            continue
        return match.group(1)
    return None


def _check_choice(item: EvalItem):
    problem = _needs_answer(item) or _only_options(item, set())
    if problem:
        return problem
    if not re.fullmatch(r"\(?[A-Ea-e]\)?", (item.answer or "").strip()):
        return "answer", f"multiple_choice answer must be a letter A-E (got {item.answer!r})"
    return None


@register_verifier("multiple_choice", _check_choice)
def multiple_choice(output: str, item: EvalItem, settings: VerifySettings) -> VerifyResult:
    want = (item.answer or "").strip().strip("()").upper()
    got = extract_choice(output)
    if got is None:
        return VerifyResult(0.0, False, "no choice letter A-E found")
    if got == want:
        return VerifyResult(1.0, True, f"chose {got}")
    return VerifyResult(0.0, False, f"expected {want}, chose {got}")


# --- ifeval -------------------------------------------------------------------------------------------


def _check_ifeval(item: EvalItem):
    problem = _only_options(item, {"constraints"})
    if problem:
        return problem
    specs = item.options.get("constraints")
    if not isinstance(specs, list) or not specs:
        return "options.constraints", "the ifeval verifier needs a non-empty list of constraints"
    for index, spec in enumerate(specs):
        reason = constraint_problem(spec)
        if reason:
            return f"options.constraints.{index}", reason
    return None


@register_verifier("ifeval", _check_ifeval)
def ifeval(output: str, item: EvalItem, settings: VerifySettings) -> VerifyResult:
    specs = item.options["constraints"]
    satisfied, failures = check_constraints(output, specs)
    score = satisfied / len(specs)
    detail = f"{satisfied}/{len(specs)} constraints satisfied"
    if failures:
        detail += "; failed: " + "; ".join(failures)
    return VerifyResult(score, not failures, detail)


# --- code ---------------------------------------------------------------------------------------------

_FENCE = re.compile(r"```([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
CODE_OPTIONS = {"timeout_s", "memory_mb", "cpu_s"}


def extract_code(output: str) -> str:
    """Python blocks (```python / ```py) if any, else untagged ``` blocks, else the whole output; blocks are joined."""
    blocks = _FENCE.findall(output)
    python = [body for tag, body in blocks if tag.lower() in ("python", "py", "python3")]
    chosen = python or [body for tag, body in blocks if not tag]
    return "\n\n".join(chosen) if chosen else output


def _check_code(item: EvalItem):
    problem = _only_options(item, CODE_OPTIONS)
    if problem:
        return problem
    if not item.tests or not item.tests.strip():
        return "tests", "the code verifier needs unit-test code in `tests`"
    for key in CODE_OPTIONS & set(item.options):
        value = item.options[key]
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            return f"options.{key}", f"must be a positive number (got {value!r})"
    return None


_STATUS_WORDS = {
    "timeout": "timed out (wall clock)",
    "cpu_limit": "CPU time limit exceeded",
    "memory": "memory limit exceeded",
    "output_limit": "output/file size limit exceeded",
    "blocked": "blocked by the sandbox",
    "killed": "killed by a signal",
    "error": "tests failed",
}
DETAIL_CHARS = 240  # of the failure's text in a detail: escaped, never the program's raw output


@register_verifier("code", _check_code)
def code(output: str, item: EvalItem, settings: VerifySettings) -> VerifyResult:
    """Run the extracted code and ``item.tests`` against it in the sandbox (``run_tests``: two processes, the
    tests call the solution through a channel); passed iff the tests ran to their end within the limits.

    Limits: ``settings.code_limits``, with the item's ``timeout_s`` / ``cpu_s`` / ``memory_mb`` options on top.
    The detail carries the status and a bounded, escaped excerpt of why the tests failed, never the
    program's output. Raises posttrain.eval.sandbox.SandboxUnavailable where code cannot be isolated and
    ``settings.allow_unsandboxed_code`` is False: a refusal is a configuration problem, not a score.
    """
    overrides: dict[str, float | int] = {}
    if "timeout_s" in item.options:
        overrides["timeout_s"] = float(item.options["timeout_s"])
    if "cpu_s" in item.options:
        overrides["cpu_s"] = int(math.ceil(item.options["cpu_s"]))
    if "memory_mb" in item.options:
        overrides["memory_mb"] = int(item.options["memory_mb"])
    limits = dataclasses.replace(settings.code_limits, **overrides)  # a copy: the caller's limits never change
    result = run_tests(extract_code(output), item.tests or "", limits, allow_unsandboxed=settings.allow_unsandboxed_code)
    isolation = "" if result.isolated else " [UNSANDBOXED]"
    if result.ok:
        return VerifyResult(1.0, True, f"tests passed in {result.duration_s:.2f}s{isolation}")
    why = _STATUS_WORDS.get(result.status, result.status)
    reason = f"after {limits.timeout_s:g}s" if result.status == "timeout" else printable_excerpt(result.failure, DETAIL_CHARS)
    return VerifyResult(0.0, False, f"{why}{': ' + reason if reason else ''}{isolation}")
