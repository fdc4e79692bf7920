"""Cached, resumable stages: a stage runs again only when its inputs or its config changed.

Each stage owns ``<run_dir>/<name>/`` and writes ``stage.json`` last, holding the *key* — a hash of
its config and of the keys of the stages it consumes — and the outputs it produced. On a re-run a
stage whose ``stage.json`` carries the same key is skipped. A stage writes ``stage.started`` with its
key first: one interrupted with the same key keeps its directory and runs again (training stages then
resume from their own checkpoints); one whose key changed starts from an empty directory, so stale
checkpoints of an old config are never resumed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGE_FILE = "stage.json"
STARTED_FILE = "stage.started"


def stable_hash(payload: Any) -> str:
    text = json.dumps(payload, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class StageResult:
    name: str
    key: str
    outputs: dict[str, Any]
    skipped: bool
    seconds: float


@dataclass
class StageRunner:
    run_dir: Path
    results: dict[str, StageResult] = field(default_factory=dict)
    log: Callable[[str], None] = lambda message: print(f"[flywheel] {message}", file=sys.stderr, flush=True)

    def run(
        self,
        name: str,
        config: Any,
        depends_on: list[str],
        body: Callable[[Path], dict[str, Any]],
    ) -> dict[str, Any]:
        """Run ``body(stage_dir) -> outputs`` unless a finished run with the same key exists."""
        key = stable_hash({"config": config, "inputs": {d: self.results[d].key for d in depends_on}})
        stage_dir = self.run_dir / name
        marker = stage_dir / STAGE_FILE
        if marker.exists():
            saved = json.loads(marker.read_text())
            if saved.get("key") == key:
                self.results[name] = StageResult(name, key, saved["outputs"], True, saved.get("seconds", 0.0))
                self.log(f"{name}: unchanged (key {key}), skipped")
                return saved["outputs"]
        started_file = stage_dir / STARTED_FILE
        if stage_dir.exists() and (not started_file.exists() or started_file.read_text() != key):
            self.log(f"{name}: config or inputs changed since its last run; starting it afresh")
            shutil.rmtree(stage_dir)
        stage_dir.mkdir(parents=True, exist_ok=True)
        started_file.write_text(key)
        self.log(f"{name}: running")
        started = time.perf_counter()
        outputs = body(stage_dir)
        seconds = time.perf_counter() - started
        marker.write_text(json.dumps({"key": key, "outputs": outputs, "seconds": seconds}, indent=1, default=str))
        self.results[name] = StageResult(name, key, outputs, False, seconds)
        self.log(f"{name}: done in {seconds:.1f}s")
        return outputs

    def timings(self) -> dict[str, float]:
        return {name: round(result.seconds, 2) for name, result in self.results.items()}


class StageInputError(ValueError):
    """A stage's input cannot be used as configured (exit 2 with one line saying what to change)."""


def count_pairs(path: Path) -> int:
    """The preference pairs in a JSONL file (its non-blank lines; 0 when rejection sampling wrote none)."""
    if not path.exists():
        return 0
    with path.open(encoding="utf-8") as handle:
        return sum(1 for line in handle if line.strip())


def skipped_dpo(pairs: int, minimum: int, more: str, lower: str) -> dict[str, Any]:
    """The outputs of a DPO stage that did not train: fewer pairs than ``dpo.min_pairs``. The round goes on
    without a DPO model, and the report shows ``skipped`` where the SFT → DPO comparison would be.
    ``more``: how to get more pairs; ``lower``: where to lower the minimum (no help when there are none)."""
    fix = f"{more}, or lower {lower} to train on them knowingly" if pairs else more
    return {"skipped": f"DPO skipped: {pairs} pairs, fewer than dpo.min_pairs={minimum}; {fix}",
            "pairs": pairs, "min_pairs": minimum}
