"""``posttrain eval``: score a model or given outputs on a suite; ``posttrain eval compare``: is a change real?

    posttrain eval --model DIR --suite NAME_OR_FILE -o results.json
    posttrain eval --outputs OUTPUTS.jsonl --suite NAME_OR_FILE -o results.json
    posttrain eval compare BASE.json NEW.json [-o comparison.json]
    posttrain eval --lm-eval TASKS --model DIR -o lm_eval.json      (needs lm-evaluation-harness)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from posttrain.generate.cli import add_sampling_arguments, backend_from_args, sampling_from_args
from posttrain.generate.prompts import (
    PromptFormatError,
    add_prompt_format_argument,
    describe_prompt_format,
    prompt_format_of_model,
)

LM_EVAL_HINT = (
    "posttrain eval --lm-eval needs lm-evaluation-harness, which is not installed.\n"
    "Install it with:  pip install 'posttrain[lm-eval]'"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="Evaluate a model (or given outputs) on a suite with CIs; `eval compare` tests a score change.",
        description=__doc__.split("\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="HF-format model directory to generate with")
    source.add_argument("--outputs", help="JSONL of {id, output} produced elsewhere (no model is loaded)")
    parser.add_argument("--suite", help="registered suite name (e.g. flywheel, smoke) or a .jsonl/.yaml/.json file")
    parser.add_argument("-o", "--output", help="results JSON (default: print the summary only)")
    parser.add_argument("--n-boot", type=int, default=1000, help="bootstrap replicates for the 95%% CIs")
    parser.add_argument("--stats-seed", type=int, default=0, help="seed of the bootstrap")
    add_prompt_format_argument(parser, legacy_flag="--raw-prompts", legacy_value="raw")
    parser.add_argument("--allow-missing", action="store_true", help="score items without an output as 0")
    parser.add_argument("--allow-unsandboxed-code", action="store_true",
                        help="run code tasks even where they cannot be isolated (eval.allow_unsandboxed_code)")
    parser.add_argument("--code-timeout", type=float, default=10.0, help="wall-clock seconds per code run")
    parser.add_argument("--code-memory-mb", type=int, default=1024, help="address-space limit per code run")
    parser.add_argument("--code-workers", type=int, default=2, help="code runs in parallel")
    parser.add_argument("--lm-eval", metavar="TASKS",
                        help="run lm-evaluation-harness tasks (comma-separated) on --model instead of a suite")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_sampling_arguments(parser, default_temperature=0.0, default_max_new_tokens=256)
    parser.set_defaults(func=_run)

    actions = parser.add_subparsers(dest="eval_action", metavar="ACTION")
    compare = actions.add_parser(
        "compare",
        help="Pair two results by item id and content: delta per capability and composite, permutation p and CI.",
        description="Compare two `posttrain eval` results on the same items (same id and same prompt, tests and "
        "answer key; items whose content differs are left out and listed). Reports, for the composite index and "
        "every group and tier, BASE -> NEW, the delta with an exact (or Monte Carlo) paired sign-flip p-value "
        "and the confidence interval that inverts the same test, so the interval excludes 0 exactly when the "
        "change is called significant. Groups and tiers are each a family: p-values are Bonferroni-adjusted "
        "and intervals simultaneous (each at 1 - alpha/m). A test whose changed items are too few to ever reach "
        "significance says 'too few items to tell'. Exit 2 when the results share no item.",
    )
    compare.add_argument("base", help="results JSON of the baseline")
    compare.add_argument("new", help="results JSON of the new model")
    compare.add_argument("-o", "--output", dest="compare_output", help="write the comparison as JSON")
    compare.add_argument("--n-perm", type=int, default=10000, help="random sign flips for the permutation test")
    compare.add_argument("--alpha", type=float, default=0.05, help="significance level of each family (default 0.05)")
    compare.add_argument("--seed", dest="compare_seed", type=int, default=0)
    compare.set_defaults(func=_compare)


def _fail(message: str) -> int:
    print(f"posttrain eval: {message}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    if args.lm_eval:
        return _run_lm_eval(args)
    if not args.suite:
        return _fail("--suite is required (a registered suite name or a suite file)")
    if not (args.model or args.outputs):
        return _fail("give --model DIR (generate and score) or --outputs FILE (score given outputs)")
    if args.n != 1:
        return _fail(f"evaluation scores one output per item: --n must be 1 (got {args.n}); draw several answers "
                     "per prompt with `posttrain generate --n` or `posttrain sample`")
    from posttrain.eval.harness import MissingOutputs, evaluate
    from posttrain.eval.items import load_suite
    from posttrain.eval.sandbox import SandboxLimits, SandboxUnavailable

    if args.outputs and args.prompt_format != "auto":
        return _fail(f"--prompt-format {args.prompt_format} applies when generating with --model; --outputs were "
                     "written elsewhere, from prompts this command never sees")
    suite = load_suite(args.suite)
    prompt_format = None
    if args.model:
        try:
            prompt_format = prompt_format_of_model(args.model, args.prompt_format)
        except PromptFormatError as exc:
            return _fail(str(exc))
        # First, before the weights load: the score is of the prompts as the model saw them.
        print(f"posttrain eval: {describe_prompt_format(prompt_format, args.prompt_format)}", file=sys.stderr)
    limits = SandboxLimits(timeout_s=args.code_timeout, cpu_s=max(1, int(args.code_timeout)),
                           memory_mb=args.code_memory_mb)
    params = sampling_from_args(args)
    try:
        source = backend_from_args(args) if args.model else args.outputs
    except (ImportError, ValueError) as exc:  # a backend that cannot be built as asked: the message says why
        return _fail(str(exc))
    try:
        results = evaluate(
            source, suite, params,
            batch_size=args.batch_size, n_boot=args.n_boot, seed=args.stats_seed,
            prompt_format=prompt_format or "auto",
            allow_missing=args.allow_missing, allow_unsandboxed_code=args.allow_unsandboxed_code,
            sandbox_limits=limits, code_workers=args.code_workers, model_name=args.model,
            progress=not args.quiet,
        )
    except (SandboxUnavailable, MissingOutputs) as exc:
        return _fail(str(exc))
    finally:
        from posttrain.generate.engine import close_backend

        close_backend(source)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=1, ensure_ascii=False), encoding="utf-8")
    print(format_scores(results))
    if args.output:
        print(f"results -> {args.output}")
    return 0


def format_scores(results: dict) -> str:
    scores = results["scores"]
    lines = [f"suite {results['suite']}: {results['counts']['passed']}/{results['counts']['items']} items passed"]
    composite = scores["composite"]
    lines.append(f"  {'composite index':<28} {composite['score']:6.1f}  95% CI [{composite['ci_low']:.1f}, {composite['ci_high']:.1f}]")
    for kind in ("groups", "tiers"):
        for name, s in scores[kind].items():
            label = f"{kind[:-1]} {name}"
            weight = f"  weight {results['weights'][name]:.2f}" if kind == "groups" else ""
            lines.append(f"  {label:<28} {s['score']:6.1f}  95% CI [{s['ci_low']:.1f}, {s['ci_high']:.1f}]  n={s['n']}{weight}")
    counts = results["counts"]
    for key in ("missing_outputs", "unmatched_outputs", "verifier_errors"):
        if counts.get(key):
            lines.append(f"  note: {counts[key]} {key.replace('_', ' ')}")
    if results.get("sandbox", {}).get("used") and not results["sandbox"]["isolated"]:
        lines.append("  WARNING: code tasks ran WITHOUT the sandbox (allow_unsandboxed_code)")
    return "\n".join(lines)


def _read_results(path: str) -> dict | str:
    """A results file, or why it is not one (``file:line`` and the column for broken JSON)."""
    from posttrain.data.io import json_syntax_error

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        line, reason = json_syntax_error(exc.doc, exc)
        return f"{path}:{line}: {reason}"
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        return f"{path}: not a `posttrain eval` results file (no `items` list)"
    for index, item in enumerate(data["items"]):
        missing = [key for key in ("id", "score") if not isinstance(item, dict) or key not in item]
        if missing:
            return f"{path}: items[{index}]: `{missing[0]}` is missing (not a `posttrain eval` results file?)"
        score = item["score"]
        if isinstance(score, bool) or not isinstance(score, int | float) or not 0 <= score <= 1:
            return f"{path}: items[{index}]: `score` must be a number in [0, 1], got {score!r}"
    return data


def _compare(args: argparse.Namespace) -> int:
    from posttrain.eval.stats import IncomparableResults, compare_results

    runs = []
    for path in (args.base, args.new):
        run = _read_results(path)
        if isinstance(run, str):
            return _fail(run)
        runs.append(run)
    suites = (runs[0].get("suite"), runs[1].get("suite"))
    try:
        result = compare_results(runs[0], runs[1], n_perm=args.n_perm, seed=args.compare_seed, alpha=args.alpha)
    except IncomparableResults as exc:
        return _fail(str(exc) + (f" (suites {suites[0]!r} and {suites[1]!r})" if suites[0] != suites[1] else ""))
    if suites[0] != suites[1]:
        print(f"note: different suites ({suites[0]} vs {suites[1]}); comparing shared items", file=sys.stderr)
    result["base"], result["new"] = args.base, args.new
    if args.compare_output:
        Path(args.compare_output).write_text(json.dumps(result, indent=1), encoding="utf-8")
    print("\n".join(result["summary"]))
    return 0


def _run_lm_eval(args: argparse.Namespace) -> int:
    try:
        import lm_eval
    except ImportError:
        print(LM_EVAL_HINT, file=sys.stderr)
        return 2
    if not args.model:
        return _fail("--lm-eval needs --model DIR")
    tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={args.model},dtype={args.dtype}",
        tasks=tasks,
        batch_size=args.batch_size,
        device=args.device or "cpu",
    )
    summary = {"model": args.model, "tasks": tasks, "results": results.get("results", {})}
    text = json.dumps(summary, indent=1, default=str)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    print(text)
    return 0
