"""Does every stage's gain hold on eval suites drawn with other generator seeds? (issue #28)

A finished ``posttrain quickstart --rl --rounds 2`` run has its verdicts on the suite of its own seed
(``compare/comparisons.json``, ``across/comparisons.json``). A gain that is real does not depend on which
held-out problems were drawn: this script draws the built-in flywheel suite again with other seeds
(``posttrain data tasks eval --seed S``; the same families, cells and size as the run's suite, different
problems wherever a family's eval split holds more than one suite needs), evaluates the run's models on each
(greedy, the run's ``eval`` settings), and repeats the run's paired comparisons:

    base -> sft, sft -> dpo, dpo -> grpo (when the run has GRPO), round 1 final -> round 2 final (when it has
    round 2)

Each comparison's **target** is what its stage trains on: the composite for SFT, DPO and the later round (their
data spans every group), the GRPO stage's own prompt groups for GRPO (recorded in its ``stage.json``). A stage
*holds* on a suite when its target is a significant gain (the report's own test: paired sign-flip permutation,
Bonferroni over groups). Prints ONE JSON line: per seed (the run's own first), per comparison, the target's
delta, interval, adjusted p and verdict, plus every group's delta.

Usage: ``python benchmarks/stage_gains.py --run-dir runs/qs [--seeds 1,2]``; figures in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="a finished quickstart/flywheel run directory")
    parser.add_argument("--seeds", default="1,2", help="suite generator seeds to redraw with (default 1,2)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--out", help="also keep the per-seed suites and results here (default: the run's "
                        "stage_gains/ directory)")
    return parser.parse_args(argv)


def run_models(run_dir: Path) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The run's evaluated models (label -> model directory) and the comparisons to repeat, in order, named as
    the run names them (round 1's final model is ``round1/<stage>`` in the across-rounds comparisons)."""
    base = json.loads((run_dir / "base" / "stage.json").read_text())["outputs"]["model"]
    models = {"base": base}
    for stage in ("sft", "dpo", "grpo"):
        if (run_dir / stage / "final").is_dir():
            models[stage] = str(run_dir / stage / "final")
    chain = list(models)
    pairs = list(zip(chain, chain[1:], strict=False))
    rounds_file = run_dir / "rounds.json"
    if rounds_file.exists():
        rounds = json.loads(rounds_file.read_text())["rounds"]
        labels = []
        for entry in rounds:
            label = entry["label"]
            in_round = run_dir / entry["dir"] / entry["final"] / "final"
            models[label] = models[entry["final"]] if entry["round"] == 1 else str(in_round)
            labels.append(label)
        pairs += list(zip(labels, labels[1:], strict=False))
    return models, pairs


def targets(run_dir: Path, pairs: list[tuple[str, str]]) -> dict[str, list[str] | None]:
    """Comparison name -> the groups its stage is judged on (None: the composite), as the report's "What each
    stage targeted" table has them (``stage_targets``: GRPO's recorded prompt groups); the across-rounds
    comparisons, and a GRPO stage of a run from before its groups were recorded, are judged on the composite."""
    from posttrain.report.collect import stage_targets

    names = [f"{base}->{new}" for base, new in pairs]
    recorded = stage_targets(run_dir, dict.fromkeys(names))
    return {name: recorded[name]["groups"] if name in recorded else None for name in names}


def verdict(comparison: dict, groups: list[str] | None) -> dict:
    """The target's test (the composite, or each targeted group) and every group's delta."""
    blocks = {"composite": comparison["composite"]} if groups is None else {g: comparison["groups"][g] for g in groups}
    from posttrain.eval.stats import verdict_kind

    held = all(verdict_kind(block) == "improvement" for block in blocks.values())  # the report's own rule
    return {
        "target": "composite" if groups is None else groups,
        "holds": held,
        "tests": {name: {"delta": round(b["delta"], 2), "ci": [round(b["ci_low"], 2), round(b["ci_high"], 2)],
                         "p_adjusted": round(b["p_adjusted"], 4), "significant": b["significant"]}
                  for name, b in blocks.items()},
        "composite_delta": round(comparison["composite"]["delta"], 2),
        "groups": {g: round(b["delta"], 2) for g, b in comparison["groups"].items()},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(args.threads)
    from posttrain.eval.harness import evaluate
    from posttrain.eval.stats import compare_results
    from posttrain.generate.engine import HFBackend, SamplingParams
    from posttrain.tasks.emit import flywheel_suite
    from posttrain.tasks.problem import GROUPS, TIERS

    started = time.perf_counter()
    run_dir = Path(args.run_dir)
    # The run's own eval settings: its base model's results (greedy, new tokens, batch size, seed) and suite size.
    settings = json.loads((run_dir / "eval_base" / "results.json").read_text())["config"]
    items = json.loads((run_dir / "data" / "stage.json").read_text())["outputs"]["counts"]["eval_items"]
    n_per_cell, run_seed = items // (len(GROUPS) * len(TIERS)), settings["seed"]
    max_new_tokens, batch_size, n_perm = settings["sampling"]["max_new_tokens"], settings["batch_size"], 5000
    models, pairs = run_models(run_dir)
    wanted = targets(run_dir, pairs)
    out_dir = Path(args.out) if args.out else run_dir / "stage_gains"
    out_dir.mkdir(parents=True, exist_ok=True)

    own = {}
    for name in ("compare/comparisons.json", "across/comparisons.json"):
        if (run_dir / name).exists():
            own.update(json.loads((run_dir / name).read_text()))
    per_seed = {f"run (seed {run_seed})": {name: verdict(own[name], wanted[name]) for name in wanted if name in own}}
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, seed=run_seed)
    backends = {path: HFBackend.from_path(path) for path in dict.fromkeys(models.values())}  # round1/x is x
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        suite = flywheel_suite(n_per_cell=n_per_cell, seed=seed)
        by_path = {}
        for path, backend in backends.items():
            by_path[path] = evaluate(backend, suite, params, batch_size=batch_size, seed=seed, model_name=path)
        results = {label: by_path[path] for label, path in models.items()}
        for label, result in results.items():
            (out_dir / f"seed{seed}-{label.replace('/', '_')}.json").write_text(json.dumps(result))
        per_seed[f"seed {seed}"] = {
            f"{base}->{new}": verdict(compare_results(results[base], results[new], n_perm=n_perm, seed=seed),
                                      wanted[f"{base}->{new}"])
            for base, new in pairs
        }
    holds = {name: all(seed_result[name]["holds"] for seed_result in per_seed.values() if name in seed_result)
             for name in wanted}
    print(json.dumps({
        "benchmark": "stage_gains", "run_dir": str(run_dir), "items_per_group": len(TIERS) * n_per_cell,
        "per_seed": per_seed, "holds_on_every_suite": holds, "seconds": round(time.perf_counter() - started, 1),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}, "
                   f"python {platform.python_version()}, torch threads {args.threads}",
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
