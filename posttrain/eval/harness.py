"""Run a suite: generate (or take given outputs), verify every item, aggregate with confidence intervals.

``evaluate`` returns the results dict that ``posttrain eval`` writes as JSON::

    {"suite", "model", "items": [{"id", "content_hash", "group", "tier", "prompt", "output", "score", "passed", "detail",
     "finish_reason"}], "scores": {"groups", "tiers", "composite"}, "weights", "config", "counts", "sandbox"}

Every suite item appears in ``items``: an item whose verifier crashed is scored 0 with the error in
``detail`` and counted in ``counts.verifier_errors``; a missing output (``--outputs`` mode) is an error
unless ``allow_missing`` is set, then it is scored 0 with detail "missing output".
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from posttrain.data.errors import DataError
from posttrain.data.io import iter_jsonl
from posttrain.eval.items import EvalItem, Suite, load_suite
from posttrain.eval.sandbox import SandboxLimits, SandboxUnavailable, sandbox_support
from posttrain.eval.stats import capability_scores
from posttrain.eval.verifiers import VerifyResult, VerifySettings, verify
from posttrain.generate.engine import Backend, SamplingParams
from posttrain.generate.prompts import apply_prompt_format, resolve_prompt_format
from posttrain.progress import progress as progress_bar


class MissingOutputs(ValueError):
    """Some suite items have no output and the caller did not allow scoring them 0."""


DEFAULT_EVAL_PARAMS = SamplingParams(n=1, temperature=0.0, max_new_tokens=256)


def read_outputs(path: str | Path) -> dict[str, str]:
    """Read ``{"id", "output"}`` lines (other keys are allowed and ignored); ids must be unique."""
    outputs: dict[str, str] = {}
    for number, data in iter_jsonl(str(path)):
        for key in ("id", "output"):
            if key not in data:
                raise DataError(str(path), number, key, "required field is missing")
        if not isinstance(data["output"], str):
            raise DataError(str(path), number, "output", f"must be a string (got {type(data['output']).__name__})")
        key = str(data["id"])
        if key in outputs:
            raise DataError(str(path), number, "id", f"duplicate id {key!r}")
        outputs[key] = data["output"]
    return outputs


def _safe_verify(item: EvalItem, output: str, settings: VerifySettings) -> tuple[VerifyResult, bool]:
    try:
        return verify(item, output, settings), False
    except SandboxUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - one broken item must not stop the run; it is reported
        return VerifyResult(0.0, False, f"verifier error: {type(exc).__name__}: {exc}"), True


def _generate(backend: Backend, suite: Suite, params: SamplingParams, batch_size: int, prompt_format: str,
              progress: bool) -> tuple[dict[str, str], dict[str, str]]:
    if params.n != 1:
        raise ValueError(f"evaluation scores one output per item; got n={params.n}")
    # The same rule as `posttrain generate` (posttrain.generate.prompts), so a prompt file reads the same on both.
    prompts = apply_prompt_format([item.prompt for item in suite.items], prompt_format)
    completions = backend.generate(prompts, params, batch_size=batch_size, progress=progress)
    outputs = {item.id: c[0].text for item, c in zip(suite.items, completions, strict=True)}
    reasons = {item.id: c[0].finish_reason for item, c in zip(suite.items, completions, strict=True)}
    return outputs, reasons


def evaluate(
    backend_or_outputs: Backend | Mapping[str, str] | str | Path,
    suite: Suite | str | Path,
    params: SamplingParams | None = None,
    *,
    batch_size: int = 8,
    n_boot: int = 1000,
    seed: int = 0,
    prompt_format: str = "auto",
    allow_missing: bool = False,
    allow_unsandboxed_code: bool = False,
    sandbox_limits: SandboxLimits | None = None,
    code_workers: int = 2,
    model_name: str | None = None,
    progress: bool = True,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate a backend (generates with ``params``, greedy by default) or given outputs (a mapping id ->
    output, or a JSONL path) on ``suite`` (a Suite, a registered name or a file).

    ``prompt_format`` (``auto``, ``chat``, ``raw``; ``posttrain.generate.prompts``): how string prompts reach the
    backend's model; ``auto`` is the chat template when the backend's tokenizer has one.

    Raises SandboxUnavailable before any generation when the suite has code items, the sandbox does not
    work here and ``allow_unsandboxed_code`` is False.
    """
    if not isinstance(suite, Suite):
        suite = load_suite(suite)
    params = params or DEFAULT_EVAL_PARAMS
    has_code = any(item.verifier == "code" for item in suite.items)
    supported, why = sandbox_support() if has_code else (True, "no code items")
    if has_code and not supported and not allow_unsandboxed_code:
        raise SandboxUnavailable(
            f"suite {suite.name!r} has code tasks but model-written code cannot be isolated here ({why}). "
            "Set eval.allow_unsandboxed_code=true (CLI: --allow-unsandboxed-code) to run them anyway, "
            "without network or file-system isolation."
        )

    finish_reasons: dict[str, str] = {}
    used_format = None  # only generation reads the prompts
    if isinstance(backend_or_outputs, str | Path):
        outputs = read_outputs(backend_or_outputs)
        source = f"outputs:{backend_or_outputs}"
    elif isinstance(backend_or_outputs, Mapping):
        outputs, source = {str(k): v for k, v in backend_or_outputs.items()}, "outputs"
    else:
        used_format = resolve_prompt_format(prompt_format, getattr(backend_or_outputs, "tokenizer", None))
        outputs, finish_reasons = _generate(backend_or_outputs, suite, params, batch_size, used_format, progress)
        source = "generated"

    missing = [item.id for item in suite.items if item.id not in outputs]
    if missing and not allow_missing:
        raise MissingOutputs(
            f"{len(missing)} of {len(suite.items)} suite items have no output (first: {', '.join(missing[:5])}); "
            "pass allow_missing (CLI: --allow-missing) to score them 0"
        )
    unmatched = sorted(set(outputs) - {item.id for item in suite.items})

    # Passed to every verify call (never set globally): concurrent evaluations keep their own limits.
    settings = VerifySettings(code_limits=sandbox_limits or SandboxLimits(),
                              allow_unsandboxed_code=allow_unsandboxed_code)
    verdicts: dict[str, tuple[VerifyResult, bool]] = {}
    with progress_bar(total=len(suite.items), desc="verify", unit="item", disable=not progress) as bar:
        plain = [item for item in suite.items if item.verifier != "code" and item.id in outputs]
        code_items = [item for item in suite.items if item.verifier == "code" and item.id in outputs]
        for item in plain:
            verdicts[item.id] = _safe_verify(item, outputs[item.id], settings)
            bar.update(1)
        # Code runs wait on subprocesses, so a few threads overlap them; each run is its own sandbox.
        with ThreadPoolExecutor(max_workers=max(1, code_workers)) as pool:
            futures = {item.id: pool.submit(_safe_verify, item, outputs[item.id], settings) for item in code_items}
            for item_id, future in futures.items():
                verdicts[item_id] = future.result()
                bar.update(1)
        bar.update(len(missing))

    rows = []
    for item in suite.items:
        if item.id in verdicts:
            result, _ = verdicts[item.id]
            output = outputs[item.id]
        else:
            result, output = VerifyResult(0.0, False, "missing output"), None
        rows.append({
            "id": item.id,
            "content_hash": item.content_hash(),  # eval compare pairs items by id *and* content
            "group": item.group,
            "tier": item.tier,
            "verifier": item.verifier,
            "prompt": item.prompt if isinstance(item.prompt, str) else [m.model_dump() for m in item.prompt],
            "answer": item.answer,
            "output": output,
            "score": float(result.score),
            "passed": bool(result.passed),
            "detail": result.detail,
            "finish_reason": finish_reasons.get(item.id),
        })
    scores = capability_scores(rows, suite.group_weights, n_boot=n_boot, seed=seed)
    weights = scores.pop("weights")
    return {
        "suite": suite.name,
        "model": model_name,
        "source": source,
        "items": rows,
        "scores": scores,
        "weights": weights,
        "suite_weights": dict(suite.group_weights),
        "counts": {
            "items": len(rows),
            "passed": sum(r["passed"] for r in rows),
            "missing_outputs": len(missing),
            "unmatched_outputs": len(unmatched),
            "verifier_errors": sum(1 for _, crashed in verdicts.values() if crashed),
        },
        "unmatched_output_ids": unmatched[:100],
        "sandbox": {"used": has_code, "isolated": supported, "how": why},
        "config": {
            "sampling": params.__dict__ if source == "generated" else None,
            "batch_size": batch_size,
            "n_boot": n_boot,
            "seed": seed,
            "prompt_format": used_format,
            "allow_unsandboxed_code": allow_unsandboxed_code,
            "sandbox_limits": (sandbox_limits or SandboxLimits()).__dict__,
            **(config or {}),
        },
    }
