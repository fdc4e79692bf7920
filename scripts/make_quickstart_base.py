"""Pretrain the quickstart's base model and ship it: ``posttrain/flywheel/packaged_base/``.

What it does is exactly what the quickstart's ``data`` and ``base`` stages do with ``base.packaged: false``:
the packaged ``quickstart`` recipe (seed 0) generates the raw pool and a 3,000-document corpus of the built-in
task text (``posttrain.tasks.corpus``: statements of the same kinds of facts the tasks ask about, no chat
format and no eval items), trains a 1,024-token BPE tokenizer on corpus + pool, builds a 4-layer, 128-wide Llama
(1.3M parameters) and pretrains it with the ``pretrain_tiny`` recipe and the quickstart's overrides (200 steps,
batch 16 × 128 tokens, lr 3e-3 cosine). Then it copies the model, tokenizer and loss curve into the package
and writes ``provenance.json``: the identity hash the flywheel compares (``posttrain.flywheel.packaged_base``),
every input it covers, and who made it, when, where and with what.

Usage (from a checkout, ~1 minute on 2 cores)::

    python scripts/make_quickstart_base.py            # rebuild posttrain/flywheel/packaged_base/
    python scripts/make_quickstart_base.py --check    # exit 1 unless the shipped base matches today's inputs

Rerun it when the quickstart's ``base`` or ``data`` section, the corpus or pool generators, the tokenizer or
the pretraining code change; the ``--check`` test in tests/flywheel/test_packaged_base.py catches the first
three.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "quickstart"


def quickstart_config(run_dir: Path, packaged: bool):
    from posttrain.config.loader import load_config
    from posttrain.flywheel.config import FlywheelRecipe

    return load_config(FlywheelRecipe, RECIPE, [f"run_dir={run_dir}", f"base.packaged={str(packaged).lower()}"])


def check() -> int:
    from posttrain.flywheel.packaged_base import base_inputs, packaged_provenance, stable_hash
    from posttrain.flywheel.run import stage_data

    with tempfile.TemporaryDirectory() as tmp:
        config = quickstart_config(Path(tmp), packaged=True)
        (Path(tmp) / "data").mkdir()
        inputs = base_inputs(config, stage_data(config, Path(tmp) / "data"))
    shipped = packaged_provenance()
    if shipped is None:
        print("no packaged base: run scripts/make_quickstart_base.py", file=sys.stderr)
        return 1
    if shipped["identity"] != stable_hash(inputs):
        differ = sorted(k for k in inputs if inputs[k] != shipped["inputs"].get(k))
        print(f"the packaged base was made from other inputs ({', '.join(differ)} differ): "
              "run scripts/make_quickstart_base.py", file=sys.stderr)
        return 1
    print(f"the packaged base matches the quickstart's inputs (identity {shipped['identity']})")
    return 0


def build() -> int:
    import torch

    from posttrain.flywheel.packaged_base import write_packaged_base
    from posttrain.flywheel.run import stage_base, stage_data
    from posttrain.threads import configure_threads

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        config = quickstart_config(run_dir, packaged=False)
        if config.threads:
            configure_threads(config.threads)
        started = time.perf_counter()
        (run_dir / "data").mkdir()
        (run_dir / "base").mkdir()
        data = stage_data(config, run_dir / "data")
        base = stage_base(config, data, run_dir / "base")
        seconds = time.perf_counter() - started
        made_by = {"command": "python scripts/make_quickstart_base.py", "date": time.strftime("%Y-%m-%d"),
                   "commit": commit or None,
                   "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, "
                              f"torch {torch.__version__}, {torch.get_num_threads()} threads"}
        provenance = write_packaged_base(config, data, base, made_by)
    print(json.dumps({"identity": provenance["identity"], "seconds": round(seconds, 1), **provenance["loss"]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare the shipped base's inputs with today's")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    return check() if args.check else build()


if __name__ == "__main__":
    raise SystemExit(main())
