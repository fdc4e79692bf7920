"""RL rewards: weighted sums of verifier, reward-model and Python terms, safe against crashing and hanging code.

A recipe's ``reward:`` section (:class:`RewardConfig`) lists terms; :class:`RewardFunction` is built from it
once per run and scores a batch of ``(prompt, completion)`` samples::

    reward_i = sum_t weight_t * value_t(prompt_i, completion_i)

- ``verifier``: ``posttrain.eval.verifiers.verify`` on the prompt as an eval item
  (``EvalItem.from_rl_prompt``: the record's verifier, answer, tests and ``meta.verifier_options``), or on the
  term's ``verifier`` instead of the record's own. Value: the verifier's score in [0, 1]; its ``passed`` feeds
  :attr:`RewardBatch.passed` (pass@1 / pass@G).
- ``reward_model``: ``posttrain.train.reward_scorer.RewardScorer`` (the model as ``posttrain rm`` exported it),
  in this process, batched, on this rank's device.
- ``python``: ``function: "module:attr"`` (an importable module: installed, or its directory on ``PYTHONPATH``) or
  ``function: "path/to/file.py:attr"`` (a file, relative to the working directory), called as
  ``fn(prompt: RLPrompt, completion: str) -> float``.

Where each runs, and why:

- verifier (except ``code``) and python terms run in a :class:`posttrain.rl.pool.TimeoutPool` of ``workers``
  processes started once, with ``timeout_s`` per item. A term that raises, hangs, returns a non-number or a
  non-finite number, or kills its process scores **0 for that term** (the sample's other terms keep their
  values) and its reason is counted in :attr:`RewardBatch.failures`. ``workers: 0`` runs them in this
  process: cheaper per item, but a hang blocks the run and a crash ends it.
- ``code`` items run from this process, a few at a time on threads, each in its own sandbox
  (``posttrain.eval.sandbox``), whose wall-clock timeout and process-tree kill are the per-item protection —
  as ``posttrain eval`` runs them. In a pool worker, a kill on ``timeout_s`` would bypass the sandbox's own
  cleanup (the sweep of leftover processes, its temporary directory without the jail) and the two timeouts
  would race; the threads only wait on subprocesses. A sandbox that cannot isolate code here is a
  configuration error (``SandboxUnavailable``, raised), not a score, unless ``code.allow_unsandboxed``.
- Reward models and a code sandbox that does not work raise: they are setup problems that would otherwise
  turn every later reward into a silent 0.

Same inputs, same rewards: results are placed by sample, terms are summed in config order, and nothing
depends on the number of workers or the order items finish.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import math
import numbers
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from posttrain.data.records import RLPrompt
from posttrain.eval.items import EvalItem
from posttrain.eval.sandbox import SandboxUnavailable
from posttrain.eval.verifiers import check_item, verify
from posttrain.rl.pool import BadValue, Outcome, TimeoutPool, failure_reason, run_inline
from posttrain.rl.reward_config import (  # noqa: F401 - re-exported
    CodeRewardConfig,
    RewardConfig,
    RewardSetupError,
    RewardTerm,
    TermKind,
)


@dataclasses.dataclass
class RewardBatch:
    """Rewards for one batch, one entry per sample in the order given.

    ``terms[label]``: each term's value before weighting (0 where it failed); ``passed``: every verifier term
    passed (None without a verifier term); ``reasons[label][i]``: why that value is 0 by failure, None when it
    was scored; ``failures``: those reasons counted ("timeout", "crashed", "error: ValueError",
    "non-finite", "not a number: str", "bad prompt: ValueError").
    """

    rewards: list[float]
    terms: dict[str, list[float]]
    passed: list[bool | None]
    failures: Counter[str]
    reasons: dict[str, list[str | None]]


def _import_file(reference: str, source: str) -> ModuleType:
    """The module of a reward file (``"path/to/file.py:attr"``), loaded once per process under a name of its own
    (kept in ``sys.modules``, so that what it defines pickles and its dataclasses work). Its own imports follow
    ``sys.path`` as usual: nothing is added to it."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise RewardSetupError(f"reward function {reference!r}: {source}: no such file under {Path.cwd()} (a file is "
                               'named "path/to/file.py:FUNCTION", relative to the directory posttrain runs in, or '
                               "absolute)")
    resolved = path.resolve()
    name = f"posttrain_reward_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}_{resolved.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's code: whatever it raises while importing is theirs to fix
        del sys.modules[name]
        raise RewardSetupError(f"reward function {reference!r}: cannot import {source} ({type(exc).__name__}: "
                               f"{exc})") from None
    return module


@cache
def resolve_function(reference: str) -> Callable[[RLPrompt, str], Any]:
    """``"module:attr"`` or ``"path/to/file.py:attr"`` (attr may be dotted) -> the callable; ``RewardSetupError``
    naming what is wrong and how to fix it."""
    source, _, attr = reference.rpartition(":")
    if source.endswith(".py"):
        target: Any = _import_file(reference, source)
    else:
        try:
            target = importlib.import_module(source)
        except Exception as exc:  # noqa: BLE001 - not found, or the module itself failed while importing
            leaf = source.rpartition(".")[2]
            raise RewardSetupError(
                f"reward function {reference!r}: cannot import {source!r} ({type(exc).__name__}: {exc}); install it, "
                f'put the directory that holds it on PYTHONPATH, or name the file: "path/to/{leaf}.py:{attr}"'
            ) from None
    for part in attr.split("."):
        if not hasattr(target, part):
            names = [name for name in dir(target) if not name.startswith("_") and callable(getattr(target, name))]
            guess = difflib.get_close_matches(part, names, n=1)
            hint = f"; did you mean {guess[0]!r}?" if guess else ""
            raise RewardSetupError(f"reward function {reference!r}: {source} has no attribute {attr!r}{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise RewardSetupError(f"reward function {reference!r} is not callable (a {type(target).__name__})")
    return target


def evaluate_job(job: tuple) -> Any:
    """One term for one sample (what a pool worker runs): ``("verify", item, completion, settings)`` ->
    (score, passed); ``("python", "module:attr", prompt, completion)`` -> float."""
    if job[0] == "verify":
        _, item, completion, settings = job
        result = verify(item, completion, settings)
        return float(result.score), bool(result.passed)
    _, reference, prompt, completion = job
    value = resolve_function(reference)(prompt, completion)
    if not isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        raise BadValue(f"not a number: {type(value).__name__}")
    return float(value)


def _sandboxed(job: tuple) -> Outcome:
    try:
        return "ok", evaluate_job(job)
    except SandboxUnavailable as exc:
        raise SandboxUnavailable(f"{exc} (for RL rewards: reward.code.allow_unsandboxed=true)") from None
    except Exception as exc:
        return "error", failure_reason(exc)


class RewardFunction:
    """Built once per run from :class:`RewardConfig`: imports the python terms, loads the reward models, starts
    the pool. ``score(prompts, completions)`` per step; ``close()`` (or ``with``) stops the workers."""

    def __init__(self, config: RewardConfig, device: Any = None):
        self.config = config
        self.settings = config.code.verify_settings()
        for term in config.terms:
            if term.kind == "python":
                resolve_function(term.function)  # a typo fails here, not as a counted error on every sample
        self._scorers: dict[str, Any] = {}
        for term in config.terms:
            if term.kind == "reward_model":
                from posttrain.train.reward_scorer import RewardScorer

                self._scorers[term.label] = RewardScorer.from_path(term.path, device=device, batch_size=term.batch_size,
                                                                   max_length=term.max_length, dtype=term.dtype)
        pooled = any(term.kind in ("verifier", "python") for term in config.terms)
        self._pool = TimeoutPool(evaluate_job, config.workers, config.timeout_s) if pooled and config.workers else None
        self._driver = ThreadPoolExecutor(1, thread_name_prefix="reward-pool") if self._pool else None
        self._code_threads: ThreadPoolExecutor | None = None

    @property
    def has_verifier(self) -> bool:
        return any(term.kind == "verifier" for term in self.config.terms)

    def check_prompts(self, prompts: Sequence[RLPrompt]) -> None:
        """Raise, at setup, what ``score`` would count on every step: a prompt its verifier terms cannot check
        (``RewardSetupError`` naming the prompt, the field and the fixes), or code items where code cannot be
        isolated."""
        from posttrain.eval.sandbox import sandbox_support

        has_code = False
        for index, term in enumerate(self.config.terms):
            if term.kind != "verifier":
                continue
            loose = [prompt for prompt in prompts if not (term.verifier or prompt.verifier)]
            if loose:
                more = f" (nor do {len(loose) - 1} more of the {len(prompts)} prompts)" if len(loose) > 1 else ""
                raise RewardSetupError(
                    f"reward term {term.label!r}: RL prompt {loose[0].id}: names no verifier{more}, so this term would "
                    "score 0 on every step. Give each prompt `verifier` and its answer key (`posttrain data tasks "
                    f"rl` writes such prompts; docs/rl.md), check every prompt with one verifier (reward.terms.{index}"
                    ".verifier=numeric, say), or score them with a python or reward_model term in reward.terms")
            for prompt in prompts:
                item = EvalItem.from_rl_prompt(prompt, term.verifier)
                problem = check_item(item)
                if problem:
                    raise RewardSetupError(f"reward term {term.label!r}: RL prompt {prompt.id}: `{problem[0]}`: "
                                           f"{problem[1]}")
                has_code = has_code or item.verifier == "code"
        supported, why = sandbox_support() if has_code else (True, "")
        if not supported and not self.config.code.allow_unsandboxed:
            raise SandboxUnavailable(f"the RL prompts have code items but code cannot be isolated here ({why}); set "
                                     "reward.code.allow_unsandboxed=true only on a machine you can afford to lose")

    def score(self, prompts: Sequence[RLPrompt], completions: Sequence[str]) -> RewardBatch:
        """Rewards for ``completions[i]`` as an answer to ``prompts[i]`` (pass a prompt object G times for its G
        samples: it converts and pickles once). One call at a time per instance."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        n = len(prompts)
        terms = self.config.terms
        values = {term.label: [0.0] * n for term in terms}
        reasons: dict[str, list[str | None]] = {term.label: [None] * n for term in terms}
        passed = {term.label: [False] * n for term in terms if term.kind == "verifier"}
        pooled, code = self._jobs(prompts, completions, reasons)

        code_futures = [self._code_pool().submit(_sandboxed, job) for _, _, job in code]
        jobs = [job for _, _, job in pooled]
        pool_future = self._driver.submit(self._pool.run, jobs) if self._driver and jobs else None
        for term in terms:  # reward models run here, on this rank's device, while the pool works
            if term.kind == "reward_model":
                rewards = self._scorers[term.label]([(p.prompt, c) for p, c in zip(prompts, completions, strict=True)])
                for index, value in enumerate(rewards):
                    self._record(("ok", value), term.label, index, values, reasons, passed)
        outcomes = pool_future.result() if pool_future else [run_inline(evaluate_job, job) for job in jobs]
        outcomes += [future.result() for future in code_futures]
        for (label, index, _), outcome in zip(pooled + code, outcomes, strict=True):
            self._record(outcome, label, index, values, reasons, passed)

        rewards = [sum(term.weight * values[term.label][i] for term in terms) for i in range(n)]
        verifier_labels = list(passed)
        passes = [all(passed[label][i] for label in verifier_labels) if verifier_labels else None for i in range(n)]
        failures = Counter(reason for column in reasons.values() for reason in column if reason is not None)
        return RewardBatch(rewards, values, passes, failures, reasons)

    def _jobs(self, prompts: Sequence[RLPrompt], completions: Sequence[str],
              reasons: dict[str, list[str | None]]) -> tuple[list, list]:
        """(label, sample, job) for the pool and for the code sandbox; a prompt that is no eval item is
        recorded as failed here."""
        pooled, code = [], []
        items: dict[tuple[int, str | None], EvalItem | str] = {}  # a prompt sampled G times converts once
        for term in self.config.terms:
            for index, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
                if term.kind == "python":
                    pooled.append((term.label, index, ("python", term.function, prompt, completion)))
                elif term.kind == "verifier":
                    key = (id(prompt), term.verifier)
                    if key not in items:
                        try:
                            items[key] = EvalItem.from_rl_prompt(prompt, term.verifier)
                        except ValueError as exc:
                            items[key] = f"bad prompt: {type(exc).__name__}"
                    item = items[key]
                    if isinstance(item, str):
                        reasons[term.label][index] = item
                        continue
                    job = ("verify", item, completion, self.settings)
                    (code if item.verifier == "code" else pooled).append((term.label, index, job))
        return pooled, code

    @staticmethod
    def _record(outcome: Outcome, label: str, index: int, values: dict, reasons: dict, passed: dict) -> None:
        status, value = outcome
        if status != "ok":
            reasons[label][index] = value if status == "error" else status
            return
        if label in passed:
            value, passed[label][index] = value
        if not math.isfinite(value):
            reasons[label][index] = "non-finite"
            if label in passed:
                passed[label][index] = False
            return
        values[label][index] = float(value)

    def _code_pool(self) -> ThreadPoolExecutor:
        if self._code_threads is None:
            self._code_threads = ThreadPoolExecutor(self.config.code.workers, thread_name_prefix="reward-code")
        return self._code_threads

    @property
    def workers_replaced(self) -> int:
        """Pool workers killed (timeout) or found dead (crash) and restarted, over the run."""
        return self._pool.replaced if self._pool else 0

    def close(self) -> None:
        """Stop the pool (a job still running is killed) and the threads; safe to call twice."""
        if self._driver is not None:
            self._driver.shutdown(wait=False, cancel_futures=True)
        if self._pool is not None:
            self._pool.close()
        if self._code_threads is not None:
            self._code_threads.shutdown(wait=True)  # each run ends within its sandbox timeout

    def __enter__(self) -> RewardFunction:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
