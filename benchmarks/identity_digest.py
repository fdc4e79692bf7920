"""A run's start-up hashing: the model's content digest read in full vs looked up by file status.

Every start and every restart of a run hashes the model's weight files for its identity
(``posttrain.train.identity``), on rank 0 while the other ranks wait. This writes ``--gib`` GiB of weight
files (random bytes, ``--files`` shards named like a sharded safetensors checkpoint), then times
``model_digest`` with an empty digest cache (every byte read and hashed) and again with the cache filled by
that first call (``posttrain.cache``: one ``stat`` per file), ``--repeats`` times each, in turn, in one
process, and prints one JSON line with the medians. The files were just written, so they sit in the page
cache: the uncached figure is the hashing cost alone, a lower bound for a cold disk or a network file system.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_model(root: Path, gib: float, files: int) -> int:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    per_file, block = int(gib * (1 << 30) / files), os.urandom(1 << 20)
    for index in range(files):
        with open(root / f"model-{index + 1:05d}-of-{files:05d}.safetensors", "wb") as handle:
            for _ in range(per_file >> 20):
                handle.write(block)
    settled = time.time() - 60  # outside the cache's racy window, as any checkpoint not just written is
    for path in root.iterdir():
        os.utime(path, (settled, settled))
    return sum(path.stat().st_size for path in root.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="posttrain-digest-bench-"))
    os.environ["XDG_CACHE_HOME"] = str(scratch / "cache-home")
    try:
        from posttrain.cache import cache_dir
        from posttrain.train.reference import model_digest

        size = write_model(scratch / "model", args.gib, args.files)
        full, cached = [], []
        for _ in range(args.repeats):
            shutil.rmtree(cache_dir("digests"), ignore_errors=True)
            start = time.perf_counter()
            digest = model_digest(str(scratch / "model"))
            full.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert model_digest(str(scratch / "model")) == digest
            cached.append(time.perf_counter() - start)
        full_s, cached_s = statistics.median(full), statistics.median(cached)
        print(json.dumps({
            "benchmark": "identity_digest", "bytes": size, "files": args.files + 1, "repeats": args.repeats,
            "full_read_s": round(full_s, 3), "full_read_gb_per_s": round(size / full_s / 1e9, 3),
            "cached_s": round(cached_s, 5), "speedup": round(full_s / cached_s, 1),
            "full_read_s_at_140_gb": round(140e9 / (size / full_s), 1),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus"}))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
