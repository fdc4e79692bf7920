"""Near-duplicate stage throughput and quality vs datasketch, in one run; prints one JSON line.

    python benchmarks/neardup.py [--docs 100000] [--workers 2] [--seed 0] [--skip-auto]

Builds a corpus with planted near-duplicates (``posttrain.curate.corpus.planted_corpus``: 10 % light
edits, Jaccard mostly 0.8-1.0; 5 % heavy edits, mostly 0.4-0.8), then runs

- ours: posttrain's near-dup stage (``NearDedupStage``: vectorised MinHash over 5-word shingles,
  112 permutations, LSH 14 bands × 8 rows, candidates verified on exact shingle-set Jaccard ≥ 0.8),
  features computed shard by shard (10k docs) and decided in one global step; once in this process
  (``ours``) and once over a ``--workers`` process pool (``ours_pool``);
- datasketch ``MinHash`` (``update_batch``) + ``MinHashLSH`` with the same shingles, 112 permutations
  and threshold 0.8, once with the same 14 × 8 banding (``datasketch``) and once with the banding
  datasketch chooses itself for that threshold (``datasketch_auto``); each document is queried then
  inserted, which yields every candidate pair.

Ground truth is exact Jaccard of the 5-word shingle sets, evaluated on every pair either method
reports and on every pair inside a planted copy family (so a pair missed by both still counts);
unrelated random documents share no shingles (see tests/curate/test_curate_minhash.py).
Throughput counts signature computation, banding and verification, not corpus generation. On a
shared machine wall time depends on what else runs, so single-process runs also report CPU time
(``time.process_time``) and the speedup is given on both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from itertools import combinations

import numpy as np

from posttrain.curate.config import ExecutorConfig, NearDedupConfig
from posttrain.curate.corpus import families, jaccard, planted_corpus, precision_recall, shingle_set
from posttrain.curate.dedup import NearDedupStage
from posttrain.curate.executor import run_tasks
from posttrain.curate.rows import Row

SHARD = 10_000


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _rows(texts: list[str], offset: int) -> list[Row]:
    return [Row(offset + i, "bench", offset + i + 1, str(offset + i),
                [{"role": "user", "content": t}, {"role": "assistant", "content": "."}]) for i, t in enumerate(texts)]  # fmt: skip


def _peak_rss_of_this_process_mb() -> float:
    """VmHWM: the high-water mark of this process's own memory (reset by exec, unlike ru_maxrss of children)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def shard_features(task: tuple[NearDedupConfig, list[str], int, str]) -> tuple[dict, float]:
    config, texts, offset, scratch = task
    stage = NearDedupStage(config)
    return stage.features(_rows(texts, offset), scratch), _peak_rss_of_this_process_mb()


def run_ours(docs: list[str], workers: int, scratch_dir: str) -> tuple[set[tuple[int, int]], tuple[float, float], float]:
    # The word rule the ground truth (5-word-shingle Jaccard) and datasketch use, not curate's default chars.
    config = NearDedupConfig(fields="prompt", shingle="words", shingle_size=5, bands=14, rows=8, threshold=0.8)
    tasks = [(config, docs[s : s + SHARD], s, f"{scratch_dir}/near-{workers}-{s}") for s in range(0, len(docs), SHARD)]
    stage = NearDedupStage(config)
    started, cpu_started = time.perf_counter(), time.process_time()
    results = run_tasks(shard_features, tasks, ExecutorConfig(workers=workers), "ours", progress=False)
    features = [features for features, _ in results]
    stage.decide(features, np.ones(len(docs), dtype=bool), [str(i) for i in range(len(docs))])
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    worker_peak = max(peak for _, peak in results)
    return {(int(a), int(b)) for a, b in stage.verified_pairs}, (seconds, cpu), worker_peak


def run_datasketch(docs: list[str], params: tuple[int, int] | None) -> tuple[set[tuple[int, int]], tuple[float, float], str]:
    from datasketch import MinHash, MinHashLSH

    started, cpu_started = time.perf_counter(), time.process_time()
    lsh = MinHashLSH(threshold=0.8, num_perm=112, params=params)
    pairs: set[tuple[int, int]] = set()
    for index, doc in enumerate(docs):
        sketch = MinHash(num_perm=112)
        sketch.update_batch([" ".join(shingle).encode("utf-8") for shingle in shingle_set(doc)])
        for other in lsh.query(sketch):
            pairs.add((other, index))
        lsh.insert(index, sketch)
    return pairs, (time.perf_counter() - started, time.process_time() - cpu_started), f"{lsh.b}x{lsh.r}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-auto", action="store_true", help="skip datasketch with its own banding")
    args = parser.parse_args()

    corpus = planted_corpus(args.docs, seed=args.seed)
    docs = corpus.docs
    rss_corpus = _rss_mb()
    with tempfile.TemporaryDirectory() as scratch:
        ours_pairs, ours_s, _ = run_ours(docs, 0, scratch)
        rss_ours = _rss_mb()
        pool_pairs, pool_s, worker_peak = run_ours(docs, args.workers, scratch)
    assert pool_pairs == ours_pairs
    sketch_pairs, sketch_s, sketch_bands = run_datasketch(docs, (14, 8))
    auto = None if args.skip_auto else run_datasketch(docs, None)

    rss_total = _rss_mb()
    evaluated = set(ours_pairs) | sketch_pairs | (auto[0] if auto else set())
    for members in families(len(docs), corpus.planted):
        evaluated.update(combinations(sorted(members), 2))
    shingles: dict[int, set] = {}

    def shingles_of(doc: int) -> set:
        if doc not in shingles:
            shingles[doc] = shingle_set(docs[doc])
        return shingles[doc]

    truth = {pair for pair in evaluated if jaccard(shingles_of(pair[0]), shingles_of(pair[1])) >= 0.8}

    def figures(pairs: set, times: tuple[float, float], pool: bool = False) -> dict:
        precision, recall = precision_recall(pairs, truth)
        wall, cpu = times
        out = {"docs_per_s": round(len(docs) / wall), "seconds": round(wall, 2)}
        if not pool:  # the parent's CPU time; a pool's work is in its children
            out.update(docs_per_cpu_s=round(len(docs) / cpu), cpu_seconds=round(cpu, 2))
        return {**out, "pairs": len(pairs), "precision": round(precision, 4), "recall": round(recall, 4)}

    result = {
        "benchmark": "neardup",
        "docs": len(docs),
        "mean_words": round(float(np.mean([len(d.split()) for d in docs])), 1),
        "planted_pairs": len(corpus.planted),
        "true_pairs_jaccard_ge_0.8": len(truth),
        "ours": figures(ours_pairs, ours_s),
        f"ours_pool_{args.workers}": figures(pool_pairs, pool_s, pool=True),
        "datasketch": {**figures(sketch_pairs, sketch_s), "bands_x_rows": sketch_bands},
        "speedup_vs_datasketch": {"cpu": round(sketch_s[1] / ours_s[1], 2), "wall": round(sketch_s[0] / ours_s[0], 2)},
        "peak_rss_mb": {"after_corpus": round(rss_corpus), "after_ours": round(rss_ours), "total": round(rss_total),
                        "pool_worker_max": round(worker_peak)},  # fmt: skip
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {sys.version.split()[0]}",
    }
    if auto:
        result["datasketch_auto"] = {**figures(auto[0], auto[1]), "bands_x_rows": auto[2]}
        result["speedup_vs_datasketch_auto"] = {"cpu": round(auto[1][1] / ours_s[1], 2),
                                                "wall": round(auto[1][0] / ours_s[0], 2)}  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
