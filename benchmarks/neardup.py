"""Near-duplicate stage vs datasketch, interleaved, plus short-text recall and scale; prints one JSON line.

    python benchmarks/neardup.py [--docs 30000] [--repeats 3] [--scale 30000,300000,1000000] [--seed 0]
                                 [--skip-auto] [--smoke]

Every figure uses **one configuration: the stage's defaults** (``NearDedupConfig()``: ``shingle: auto``,
so character 5-grams below 100 words and 5-word shingles from there, 112 bins, LSH 22 × 5,
threshold 0.7, exact verification). Only ``fields`` follows the data: the synthetic documents are
single texts (``fields: prompt``); the real short answers are chats (``fields: both``, with the
prompt check on).

- ``long``: ``posttrain.curate.corpus.planted_corpus`` with 100-300 words per document (10 % light
  edits, 5 % heavy edits for precision). Ours (features shard by shard, 10k rows, then one global
  decision, in this process) and datasketch 2.0 (``MinHash.update_batch`` + ``MinHashLSH``, the same
  5-word shingles, 112 permutations, threshold 0.7, the same 22 × 5 banding; each document queried
  then inserted) take turns ``--repeats`` times, with ``ours_process`` — the whole ``posttrain curate``
  process (start-up, reading the records, writing kept and dropped; every other stage off, one worker; its
  modules compiled to bytecode first, as an install leaves them) — so load from other jobs falls on all three; medians and their ratios are reported, wall and CPU, and the
  process's clusters must be the in-process stage's. ``datasketch_auto`` runs once with the banding datasketch
  picks for 0.7. Ground truth: exact Jaccard ≥ 0.7 of the 5-word shingle sets, on every pair any
  method reports and every pair inside a planted copy family. ``ours_pool_2`` runs once over a
  2-process pool and must report the same pairs.
- ``short_real``: every response of 15-40 words in the vendored calibration set
  (``posttrain.curate.calibration``, real documentation text) gets a two-word edit
  (``calibrate.plant_word_edits``); the stage runs on all 660 clean records + the edits. Recall = edits
  clustered with their source; precision = flagged pairs inside one record's family.
- ``short_synthetic``: 15-40-word random Zipf-word texts, 10 % two-word substitutions of an earlier one.
- ``scale``: ours alone at each ``--scale`` size (synthetic 100-300-word documents, 10 % light copies
  within each 10k shard), generated shard by shard; time excludes generation.

``--smoke`` shrinks everything to seconds (the test in tests/benchmarks runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from itertools import combinations

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from posttrain.curate.config import ExecutorConfig, NearDedupConfig  # noqa: E402
from posttrain.curate.corpus import families, jaccard, planted_corpus, precision_recall, shingle_set  # noqa: E402
from posttrain.curate.dedup import NearDedupStage  # noqa: E402
from posttrain.curate.executor import run_tasks  # noqa: E402
from posttrain.curate.minhash import connected_components  # noqa: E402
from posttrain.curate.rows import Row  # noqa: E402

SHARD = 10_000
THRESHOLD = NearDedupConfig().threshold
DOCUMENTS = NearDedupConfig(fields="prompt")  # the defaults; a document is one text


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _rows(texts: list[str], offset: int) -> list[Row]:
    return [Row(offset + i, "bench", offset + i + 1, str(offset + i),
                [{"role": "user", "content": t}, {"role": "assistant", "content": "."}]) for i, t in enumerate(texts)]  # fmt: skip


def shard_features(task: tuple[NearDedupConfig, list[str], int, str]) -> dict:
    config, texts, offset, scratch = task
    return NearDedupStage(config).features(_rows(texts, offset), scratch)


def run_ours(docs: list[str], workers: int, scratch: str) -> tuple[set[tuple[int, int]], tuple[float, float]]:
    tasks = [(DOCUMENTS, docs[s : s + SHARD], s, f"{scratch}/near-{workers}-{s}") for s in range(0, len(docs), SHARD)]
    stage = NearDedupStage(DOCUMENTS)
    started, cpu_started = time.perf_counter(), time.process_time()
    features = run_tasks(shard_features, tasks, ExecutorConfig(workers=workers), "ours", progress=False)
    stage.decide(features, np.ones(len(docs), dtype=bool), [str(i) for i in range(len(docs))])
    times = time.perf_counter() - started, time.process_time() - cpu_started
    return {(int(a), int(b)) for a, b in stage.verified_pairs}, times


ONLY_NEAR_DEDUP = [f"{stage}.enabled=false" for stage in (
    "normalize", "filters", "exact_dedup", "semantic_dedup", "verify", "judge", "model_judge", "intent", "difficulty")]


def write_records(docs: list[str], path: str) -> None:
    """The documents as SFT records (a fixed question, the document as the answer) for ``posttrain curate``."""
    with open(path, "w", encoding="utf-8") as handle:
        for doc in docs:
            handle.write(json.dumps({"prompt": "Write the passage.", "response": doc}) + "\n")


def compile_bytecode() -> None:
    """posttrain's modules compiled to bytecode, as ``pip install`` leaves them. Where the environment sets
    ``PYTHONDONTWRITEBYTECODE`` (this VM does), a module edited since its last compile is otherwise compiled
    again at every start of the timed process (measured: 0.03-0.1 s of ~2 s, depending on the edits)."""
    import compileall

    import posttrain

    compileall.compile_dir(os.path.dirname(posttrain.__file__), quiet=1)


def run_process(records: str, workers: int, scratch: str) -> tuple[set[frozenset[int]], tuple[float, float]]:
    """The whole ``posttrain curate`` process with only near-dup on (``near_dedup.fields=response``, the stage's
    other defaults): start-up, reading, the stage, writing. Wall and the child's CPU seconds, and the clusters
    (document indices) from the ``near_dup_cluster`` annotations of the kept and the dropped records."""
    import subprocess

    out = tempfile.mkdtemp(dir=scratch)
    command = [sys.executable, "-m", "posttrain", "curate", "--config", "curate", f"data.input={records}",
               f"output_dir={out}", "near_dedup.fields=response", f"executor.workers={workers}", "progress=false",
               *ONLY_NEAR_DEDUP]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    clusters: dict[str, set[int]] = {}
    with open(os.path.join(out, "kept.jsonl"), encoding="utf-8") as handle:
        for line in handle:
            curate = json.loads(line)["meta"]["curate"]
            cluster = (curate.get("scores") or {}).get("near_dup_cluster")
            if cluster is not None:
                clusters.setdefault(cluster, set()).add(curate["line"] - 1)
    with open(os.path.join(out, "dropped.jsonl"), encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if row.get("reason") == "near_duplicate":
                clusters.setdefault(row["scores"]["near_dup_cluster"], set()).add(row["line"] - 1)
    return {frozenset(members) for members in clusters.values() if len(members) > 1}, (wall, cpu)


def clusters_of(pairs: set[tuple[int, int]], n: int) -> set[frozenset[int]]:
    """The connected components of ``pairs`` with two or more members, as the stage keeps one of each."""
    labels = connected_components(n, np.array(sorted(pairs), dtype=np.int64).reshape(-1, 2))
    members: dict[int, set[int]] = {}
    for index in {i for pair in pairs for i in pair}:
        members.setdefault(int(labels[index]), set()).add(index)
    return {frozenset(group) for group in members.values() if len(group) > 1}


def run_datasketch(docs: list[str], params: tuple[int, int] | None) -> tuple[set[tuple[int, int]], tuple[float, float], str]:
    from datasketch import MinHash, MinHashLSH

    started, cpu_started = time.perf_counter(), time.process_time()
    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=112, params=params)
    pairs: set[tuple[int, int]] = set()
    for index, doc in enumerate(docs):
        sketch = MinHash(num_perm=112)
        sketch.update_batch([" ".join(shingle).encode("utf-8") for shingle in shingle_set(doc)])
        for other in lsh.query(sketch):
            pairs.add((other, index))
        lsh.insert(index, sketch)
    return pairs, (time.perf_counter() - started, time.process_time() - cpu_started), f"{lsh.b}x{lsh.r}"


def long_texts(args: argparse.Namespace) -> dict:
    corpus = planted_corpus(args.docs, seed=args.seed, min_words=100, max_words=300)
    docs = corpus.docs
    runs: dict[str, list] = {"ours": [], "datasketch": [], "process": []}
    with tempfile.TemporaryDirectory() as scratch:
        records = os.path.join(scratch, "records.jsonl")
        write_records(docs, records)
        compile_bytecode()
        for _ in range(args.repeats):  # turns: other jobs' load falls on all three alike
            runs["ours"].append(run_ours(docs, 0, scratch))
            runs["process"].append(run_process(records, 0, scratch))
            pairs, times, bands = run_datasketch(docs, (DOCUMENTS.bands, DOCUMENTS.rows))
            runs["datasketch"].append((pairs, times))
        pool_pairs, pool_times = run_ours(docs, 2, scratch)
    ours_pairs, sketch_pairs = runs["ours"][0][0], runs["datasketch"][0][0]
    assert all(p == ours_pairs for p, _ in runs["ours"]) and pool_pairs == ours_pairs, "ours is not deterministic"
    auto = None if args.skip_auto else run_datasketch(docs, None)

    evaluated = ours_pairs | sketch_pairs | (auto[0] if auto else set())
    for members in families(len(docs), corpus.planted):
        evaluated.update(combinations(sorted(members), 2))
    shingles: dict[int, set] = {}

    def shingles_of(doc: int) -> set:
        if doc not in shingles:
            shingles[doc] = shingle_set(docs[doc])
        return shingles[doc]

    truth = {pair for pair in evaluated if jaccard(shingles_of(pair[0]), shingles_of(pair[1])) >= THRESHOLD}

    def figures(pairs: set, times: list[tuple[float, float]]) -> dict:
        precision, recall = precision_recall(pairs, truth)
        wall, cpu = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
        return {"seconds_median": round(wall, 3), "cpu_seconds_median": round(cpu, 3),
                "seconds": [round(t[0], 2) for t in times], "docs_per_s": round(len(docs) / wall),
                "pairs": len(pairs), "precision": round(precision, 4), "recall": round(recall, 4)}  # fmt: skip

    ours = figures(ours_pairs, [t for _, t in runs["ours"]])
    process_wall = statistics.median(t[0] for _, t in runs["process"])
    process_cpu = statistics.median(t[1] for _, t in runs["process"])
    same_clusters = all(c == clusters_of(ours_pairs, len(docs)) for c, _ in runs["process"])
    sketch = {**figures(sketch_pairs, [t for _, t in runs["datasketch"]]), "bands_x_rows": bands}
    paired = [s[1][0] / o[1][0] for o, s in zip(runs["ours"], runs["datasketch"], strict=True)]
    result = {
        "docs": len(docs),
        "mean_words": round(float(np.mean([len(d.split()) for d in docs])), 1),
        "true_pairs": len(truth),
        "ours": ours,
        "datasketch": sketch,
        "speedup": {"wall": round(sketch["seconds_median"] / ours["seconds_median"], 2),
                    "cpu": round(sketch["cpu_seconds_median"] / ours["cpu_seconds_median"], 2),
                    "wall_paired_median": round(statistics.median(paired), 2)},  # fmt: skip
        "ours_pool_2": {"seconds": round(pool_times[0], 2), "same_pairs": pool_pairs == ours_pairs},
        # the whole `posttrain curate` process (start-up, reading, writing), one worker, its clusters the stage's
        "ours_process": {"seconds_median": round(process_wall, 3), "cpu_seconds_median": round(process_cpu, 3),
                         "seconds": [round(t[0], 2) for _, t in runs["process"]], "same_clusters": same_clusters,
                         "speedup_wall": round(sketch["seconds_median"] / process_wall, 2),
                         "speedup_cpu": round(sketch["cpu_seconds_median"] / process_cpu, 2)},
    }
    if auto:
        result["datasketch_auto"] = {**figures(auto[0], [auto[1]]), "bands_x_rows": auto[2]}
    return result


def _family_quality(rows: list[Row], family: np.ndarray, edited: np.ndarray, source: np.ndarray, config: NearDedupConfig) -> dict:
    """Run the stage on ``rows``; recall = edited rows clustered with their source, precision = pairs within a family."""
    stage = NearDedupStage(config)
    with tempfile.TemporaryDirectory() as scratch:
        stage.decide([stage.features(rows, f"{scratch}/s")], np.ones(len(rows), dtype=bool), [r.id for r in rows])
    pairs = stage.verified_pairs
    labels = connected_components(len(rows), pairs)
    right = family[pairs[:, 0]] == family[pairs[:, 1]] if pairs.size else np.zeros(0, dtype=bool)
    return {"edits": int(edited.size), "recall": round(float((labels[edited] == labels[source]).mean()), 4),
            "pairs": int(pairs.shape[0]), "precision": round(float(right.mean()), 4) if pairs.size else 1.0}  # fmt: skip


def short_real(seed: int) -> dict:
    from posttrain.config import load_config
    from posttrain.curate.calibrate import _EDITABLE, load_calibration_set, normalized_rows, plant_word_edits
    from posttrain.curate.config import CurateRecipe

    recipe = load_config(CurateRecipe, None, ["data.input=calibration", "output_dir=unused"])
    records = load_calibration_set()
    rng = random.Random(seed)
    vocabulary = sorted({w.lower() for r in records for w in _EDITABLE.findall(r["response"]) if 3 <= len(w) <= 10})
    chosen = [i for i, r in enumerate(records) if 15 <= len(r["response"].split()) <= 40]
    edits = [{**records[i], "id": f"{records[i]['id']}#edit", "response": plant_word_edits(records[i]["response"], rng, vocabulary)}
             for i in chosen]  # fmt: skip
    rows = normalized_rows(records + edits, recipe)
    family = np.array(list(range(len(records))) + chosen)
    edited = np.arange(len(records), len(rows))
    return {"texts": len(records), **_family_quality(rows, family, edited, np.array(chosen), recipe.near_dedup)}


def _zipf_tokens(rng: np.random.Generator, vocab_size: int, count: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, vocab_size + 1) ** 0.8
    return np.minimum(np.searchsorted(np.cumsum(weights / weights.sum()), rng.random(count)), vocab_size - 1)


def synthetic(n: int, seed: int, min_words: int, max_words: int, edits: tuple[int, int]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``n`` Zipf-word texts; 10 % copy an earlier one with ``edits`` word substitutions. Returns (texts, copies, sources)."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i:x}q" for i in rng.permutation(20_000)]
    lengths = rng.integers(min_words, max_words + 1, size=n)
    tokens = _zipf_tokens(rng, len(vocab), int(lengths.sum()))
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    docs = [tokens[bounds[i] : bounds[i + 1]] for i in range(n)]
    copies = np.flatnonzero(rng.random(n) < 0.1)
    copies = copies[copies > 0]
    sources = (rng.random(copies.size) * copies).astype(np.int64)
    for copy, source in zip(copies.tolist(), sources.tolist(), strict=True):
        doc = docs[source].copy()
        changed = rng.choice(doc.size, size=min(int(rng.integers(edits[0], edits[1] + 1)), doc.size), replace=False)
        doc[changed] = (doc[changed] + 1 + rng.integers(0, len(vocab) - 1, size=changed.size)) % len(vocab)
        docs[copy] = doc
    return [" ".join([vocab[t] for t in doc.tolist()]) for doc in docs], copies, sources


def short_synthetic(n: int, seed: int) -> dict:
    texts, copies, sources = synthetic(n, seed, 15, 40, (2, 2))
    family = np.arange(n)
    for copy, source in zip(copies.tolist(), sources.tolist(), strict=True):  # sources come first: one pass suffices
        family[copy] = family[source]
    return {"texts": n, **_family_quality(_rows(texts, 0), family, copies, sources, DOCUMENTS)}


def scale(sizes: list[int], seed: int) -> list[dict]:
    out = []
    for size in sizes:
        stage, features, seconds, cpu = NearDedupStage(DOCUMENTS), [], 0.0, 0.0
        with tempfile.TemporaryDirectory() as scratch:
            for shard, start in enumerate(range(0, size, SHARD)):
                texts, _, _ = synthetic(min(SHARD, size - start), seed * 7919 + shard, 100, 300, (0, 4))
                rows = _rows(texts, start)
                started, cpu_started = time.perf_counter(), time.process_time()
                features.append(stage.features(rows, f"{scratch}/s{shard}"))
                seconds, cpu = seconds + time.perf_counter() - started, cpu + time.process_time() - cpu_started
            started, cpu_started = time.perf_counter(), time.process_time()
            stage.decide(features, np.ones(size, dtype=bool), [str(i) for i in range(size)])
            decide_s = time.perf_counter() - started
            seconds, cpu = seconds + decide_s, cpu + time.process_time() - cpu_started
        out.append({"docs": size, "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "decide_seconds": round(decide_s, 2),
                    "docs_per_s": round(size / seconds), "pairs": int(stage.verified_pairs.shape[0]), "peak_rss_mb": round(_rss_mb())})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=30_000, help="long documents in the comparison with datasketch")
    parser.add_argument("--repeats", type=int, default=3, help="turns of ours and datasketch")
    parser.add_argument("--scale", default="30000,300000,1000000", help="sizes timed for ours alone")
    parser.add_argument("--short-docs", type=int, default=20_000, help="texts in the synthetic short-text set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-auto", action="store_true", help="skip datasketch with its own banding")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test")
    args = parser.parse_args()
    if args.smoke:
        args.docs, args.repeats, args.scale, args.short_docs, args.skip_auto = 800, 1, "2000,5000", 500, True
    started = time.perf_counter()
    load = os.getloadavg()[0]
    long = long_texts(args)
    real, synth = short_real(args.seed), short_synthetic(args.short_docs, args.seed)
    sizes = scale([int(s) for s in args.scale.split(",") if s], args.seed)
    goal = {
        "long_10x_wall": long["speedup"]["wall"] >= 10,
        "long_10x_wall_whole_process": long["ours_process"]["speedup_wall"] >= 10,
        "long_recall_precision_0.97": min(long["ours"]["recall"], long["ours"]["precision"]) >= 0.97,
        "short_recall_0.9_precision_0.95": min(real["recall"], synth["recall"]) >= 0.9
        and min(real["precision"], synth["precision"]) >= 0.95,
    }
    print(json.dumps({
        "benchmark": "neardup",
        "config": "NearDedupConfig() defaults (fields=prompt for single documents, both for chats)",
        "long": long,
        "short_real": real,
        "short_synthetic": synth,
        "scale": sizes,
        "goal_met": goal,
        "total_seconds": round(time.perf_counter() - started),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {load:.1f}-{os.getloadavg()[0]:.1f}, "
                   f"python {sys.version.split()[0]}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
