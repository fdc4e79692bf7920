"""Before/after: posttrain's SFT and DPO throughput at another git revision and at this checkout, taking turns.

    python benchmarks/revisions.py --base REV [--rounds 3]

Makes a temporary ``git worktree`` of ``REV``, then runs ``benchmarks/sft_throughput.py`` (posttrain
only, no activation checkpointing, 2 threads) and ``benchmarks/dpo_throughput.py`` (posttrain only,
prefix sharing, 1 thread) from each tree in alternation — base, this, base, this, … — on the same
model and data, in this checkout's virtual environment (``PYTHONPATH`` picks the tree). Alternating
rounds share whatever else the machine is doing, so the median ratio of this/base is what to quote.
Each benchmark script is the one of its own tree (a revision measures itself the way it was measured
then). Prints one JSON line: per tree the median tokens/s (SFT), pairs/s (DPO) and peak RSS, and the
ratios this/base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_json(tree: Path, args: list[str], threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "POSTTRAIN_PROGRESS": "off"}
    proc = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:1])} in {tree} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sft_figures(tree: Path, model: str, data: str, work: Path) -> dict:
    out = _run_json(tree, ["benchmarks/sft_throughput.py", "--model", model, "--data", data, "--ac", "none",
                           "--frameworks", "posttrain", "--threads", "2", "--work-dir", str(work)], threads=2)
    figures = out["frameworks"]["posttrain"]
    return {"tokens_per_s": figures["tokens_per_s"], "peak_rss_mb": figures["peak_rss_mb"],
            "final_loss": figures["final_loss"][-1]}


def dpo_figures(tree: Path, work: Path) -> dict:
    out = _run_json(tree, ["benchmarks/dpo_throughput.py", "--threads", "1", "--skip-trl", "--skip-no-sharing",
                           "--workdir", str(work)], threads=1)
    figures = out["posttrain"]
    return {"pairs_per_s": figures["pairs_per_s"], "peak_rss_mb": figures["peak_rss_mb"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against (e.g. a commit before a change)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per benchmark")
    parser.add_argument("--work-dir", default="runs/bench/revisions", help="inputs and runs")
    args = parser.parse_args(argv)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sft_throughput import build_default_inputs

    model, data = (str(p) for p in build_default_inputs(work / "sft-inputs", 2000))
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="posttrain-base-") as scratch:
        base = Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
        try:
            trees = {"base": base, "this": ROOT}
            results: dict[str, dict[str, list[dict]]] = {name: {"sft": [], "dpo": []} for name in trees}
            for kind in ("sft", "dpo"):
                for round_index in range(args.rounds):
                    for name, tree in trees.items():
                        run_dir = work / f"{kind}-{name}-r{round_index}"
                        figures = (sft_figures(tree, model, data, run_dir) if kind == "sft"
                                   else dpo_figures(tree, run_dir))
                        results[name][kind].append(figures)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)

    def median(name: str, kind: str, key: str) -> float:
        return round(statistics.median(r[key] for r in results[name][kind]), 2)

    summary = {name: {"sft_tokens_per_s": median(name, "sft", "tokens_per_s"),
                      "sft_peak_rss_mb": median(name, "sft", "peak_rss_mb"),
                      "sft_final_loss": results[name]["sft"][-1]["final_loss"],
                      "dpo_pairs_per_s": median(name, "dpo", "pairs_per_s"),
                      "dpo_peak_rss_mb": median(name, "dpo", "peak_rss_mb")} for name in results}
    print(json.dumps({
        "benchmark": "revisions", "base": args.base, "rounds": args.rounds, **summary,
        "sft_speed_this_over_base": round(summary["this"]["sft_tokens_per_s"] / summary["base"]["sft_tokens_per_s"], 3),
        "dpo_speed_this_over_base": round(summary["this"]["dpo_pairs_per_s"] / summary["base"]["dpo_pairs_per_s"], 3),
        "per_round": results, "load_avg_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "cores": os.cpu_count(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
