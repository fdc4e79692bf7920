"""Cached, resumable stages: a stage runs again only when its inputs or its config changed.

Each stage owns ``<run_dir>/<name>/`` and writes ``stage.json`` last, holding the *key* — a hash of
its config and of the keys of the stages it consumes — and the outputs it produced. On a re-run a
stage whose ``stage.json`` carries the same key is skipped; one that was interrupted has no
``stage.json`` and runs again (training stages then resume from their own checkpoints).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGE_FILE = "stage.json"


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
            marker.unlink()  # inputs or config changed: the old result is stale
        stage_dir.mkdir(parents=True, exist_ok=True)
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
