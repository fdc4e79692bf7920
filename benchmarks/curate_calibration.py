"""Curation defaults on real, clean text; prints one JSON line.

    python benchmarks/curate_calibration.py [--seed 0]

Runs ``posttrain.curate.calibrate`` on the vendored calibration set
(``posttrain/curate/calibration/real_text.jsonl.gz``: Python reference topics and docstrings, Debian
package descriptions; provenance in that folder's README) with the curate recipe's defaults, and,
side by side, with the previous near-dup rule (5-word shingles, Jaccard 0.8, 14 × 8 bands) and
Gopher's repetition limits without the length allowance. Figures: share of clean records dropped by
the heuristic filters (by reason), near-dup recall on two-word edits of short (≤ 60 words) and
longer responses, precision over every flagged pair among clean records + edits, and the tier
spread of the kept records. Also the near-dup stage's CPU time on the built-in 4 000-record pool.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from posttrain.config import load_config  # noqa: E402
from posttrain.curate.calibrate import calibrate, load_calibration_set, normalized_rows  # noqa: E402
from posttrain.curate.config import CurateRecipe  # noqa: E402
from posttrain.curate.dedup import NearDedupStage  # noqa: E402

WORD_SHINGLES = ["near_dedup.shingle=words", "near_dedup.bands=14", "near_dedup.rows=8", "near_dedup.threshold=0.8",
                 "near_dedup.min_prompt_jaccard=null"]  # fmt: skip
GOPHER_LIMITS = ["filters.repetition_allowance=0"]


def recipe(*overrides: str) -> CurateRecipe:
    return load_config(CurateRecipe, None, ["data.input=calibration", "output_dir=unused", *overrides])


def pool_near_dup_cpu(config: CurateRecipe, repeats: int = 3) -> dict:
    """Median CPU seconds of the near-dup stage on the quickstart's raw pool (4 000 records), and its drops."""
    from posttrain.tasks.pool import raw_pool

    records = [r for r in raw_pool(4000, seed=0, preamble_share=0.3) if r["response"].strip()]
    rows = normalized_rows(records, config)
    times, drops = [], 0
    for _ in range(repeats):
        stage = NearDedupStage(config.near_dedup)
        with tempfile.TemporaryDirectory() as scratch:
            started = time.process_time()
            decisions = stage.decide([stage.features(rows, f"{scratch}/s")], np.ones(len(rows), bool), [r.id for r in rows])
            times.append(time.process_time() - started)
        drops = len(decisions.drops)
        clean = sum(records[i]["meta"]["planted"] is None for i in decisions.drops)
    return {"cpu_s": round(float(np.median(times)), 3), "near_dup_drops": drops, "clean_dropped": clean}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="Seed of the planted word edits.")
    args = parser.parse_args()
    records = load_calibration_set()
    default = calibrate(recipe(), records, seed=args.seed)
    words = calibrate(recipe(*WORD_SHINGLES), records, seed=args.seed)["near_dup"]
    gopher = calibrate(recipe(*GOPHER_LIMITS), records, seed=args.seed)
    for result in (default["near_dup"], words):
        result["false_pairs"] = len(result["false_pairs"])
    print(json.dumps({
        "benchmark": "curate_calibration",
        **default,
        "previous_near_dup_word5": words,
        "gopher_limits_filter_drop_rate": gopher["filter_drop_rate"],
        "gopher_limits_filter_drops": gopher["filter_drops"],
        "pool_near_dup": pool_near_dup_cpu(recipe()),
        "pool_near_dup_word5": pool_near_dup_cpu(recipe(*WORD_SHINGLES)),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
