"""The funnel (records in, kept and dropped per stage and reason) and the dataset manifest (lineage).

Invariant, checked before anything is written: ``input = kept + Σ dropped``. A stage that loses a
row without a reason breaks it, and the run fails loudly instead of writing a dataset that
silently misses records.

The manifest of each output dataset records its content hash, the content hashes of its parent
datasets (and the manifest hash of a parent that has one, so rounds of the flywheel chain), the
hash of the config that produced it, the funnel, and the posttrain version. Hashes cover content
only, never paths or times, so re-running the same config on the same inputs reproduces them.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from posttrain import __version__
from posttrain.data.storage import sha256_file


@dataclass
class StageCount:
    stage: str
    seen: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)

    def add(self, seen: int, kept: int, dropped: Counter | dict[str, int]) -> None:
        self.seen += seen
        self.kept += kept
        self.dropped.update(dropped)


class FunnelError(RuntimeError):
    pass


class Funnel:
    """Counts per stage, in stage order, merged from every shard."""

    def __init__(self, stages: list[str]):
        self.stages = {name: StageCount(name) for name in stages}
        self.input = 0
        self.extra: dict[str, Any] = {}

    def add(self, stage: str, seen: int, kept: int, dropped: Counter | dict[str, int]) -> None:
        if stage not in self.stages:
            self.stages[stage] = StageCount(stage)
        self.stages[stage].add(seen, kept, dropped)

    def merge(self, counts: dict[str, tuple[int, int, dict[str, int]]]) -> None:
        for stage, (seen, kept, dropped) in counts.items():
            self.add(stage, seen, kept, dropped)

    @property
    def dropped_total(self) -> int:
        return sum(sum(count.dropped.values()) for count in self.stages.values())

    def check(self, kept: int) -> None:
        """Raise unless input = kept + Σ dropped and each stage's seen = kept + dropped."""
        problems = []
        for count in self.stages.values():
            if count.seen and count.seen != count.kept + sum(count.dropped.values()):
                problems.append(f"stage {count.stage}: saw {count.seen}, kept {count.kept}, dropped {count.dropped}")
        if self.input != kept + self.dropped_total:
            problems.append(f"input {self.input} != kept {kept} + dropped {self.dropped_total}")
        if problems:
            raise FunnelError("funnel does not add up (a stage lost records): " + "; ".join(problems))

    def to_dict(self, kept: int) -> dict[str, Any]:
        return {
            "input": self.input,
            "kept": kept,
            "dropped": self.dropped_total,
            "stages": [
                {
                    "stage": count.stage,
                    "in": count.seen,
                    "kept": count.kept,
                    "dropped": dict(sorted(count.dropped.items(), key=lambda item: (-item[1], item[0]))),
                }
                for count in self.stages.values()
                if count.seen or count.dropped
            ],
            **self.extra,
        }


def format_funnel(funnel: dict[str, Any]) -> str:
    """A plain-text table of the funnel for the terminal and the docs."""
    width = max([len(stage["stage"]) for stage in funnel["stages"]] + [5])
    lines = [f"{'stage':<{width}}  {'in':>8}  {'kept':>8}  {'dropped':>8}  reasons"]
    for stage in funnel["stages"]:
        reasons = ", ".join(f"{reason}={count}" for reason, count in stage["dropped"].items())
        dropped = sum(stage["dropped"].values())
        lines.append(f"{stage['stage']:<{width}}  {stage['in']:>8}  {stage['kept']:>8}  {dropped:>8}  {reasons}")
    lines.append(f"input {funnel['input']} = kept {funnel['kept']} + dropped {funnel['dropped']}")
    for key, value in funnel.items():
        if key not in ("input", "kept", "dropped", "stages"):
            lines.append(f"{key}: {json.dumps(value, sort_keys=True)}")
    return "\n".join(lines)


# -- hashing and manifests -----------------------------------------------------------------
def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes; of a directory (a saved HF dataset), of its files' relative names and hashes."""
    path = Path(path)
    if path.is_dir():
        listing = [f"{file.relative_to(path).as_posix()}\t{file_sha256(file)}"
                   for file in sorted(path.rglob("*")) if file.is_file()]  # fmt: skip
        return hashlib.sha256("\n".join(listing).encode("utf-8")).hexdigest()
    return sha256_file(path)


def config_hash(config: BaseModel, exclude: set[str] | None = None) -> str:
    """sha256 of the config's canonical JSON, leaving out keys that do not change the result
    (output paths, executor) and input paths (the inputs enter the lineage by content hash)."""
    payload = config.model_dump(mode="json", exclude=exclude or set())
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def parent_entry(path: str | Path) -> dict[str, Any]:
    """A parent dataset: its content hash, plus its own manifest's dataset id when it has one. ``path`` may be
    a local file or directory (a saved dataset) or an object-store URL (read through fsspec)."""
    from posttrain.data.storage import filesystem, is_remote, storage_errors

    if is_remote(str(path)):
        with storage_errors(str(path)):
            fs, where = filesystem(str(path))
            entry: dict[str, Any] = {"path": str(path), "sha256": sha256_file(where, fs)}
            manifest_text = _read_if_exists(fs, where.rsplit("/", 1)[0] + "/manifest.json")
    else:
        path = Path(path)
        entry = {"path": str(path), "sha256": file_sha256(path)}
        manifest = path.parent / "manifest.json"
        manifest_text = manifest.read_bytes() if manifest.exists() else None
    if manifest_text is not None:
        try:
            data = json.loads(manifest_text)
            for output in data.get("outputs", {}).values():
                if output.get("sha256") == entry["sha256"]:
                    entry["dataset_id"] = data.get("dataset_id")
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            entry["manifest_error"] = "unreadable manifest.json beside this file"
    return entry


def _read_if_exists(fs, path: str) -> bytes | None:
    return fs.cat_file(path) if fs.exists(path) else None


def write_manifest(
    output_dir: str | Path,
    kind: str,
    outputs: dict[str, str | Path],
    parents: list[str | Path],
    config: BaseModel,
    funnel: dict[str, Any],
    exclude: set[str] | None = None,
) -> dict[str, Any]:
    """Write ``manifest.json``; ``dataset_id`` hashes outputs, parents and config (not paths or times)."""
    hashed_outputs = {name: {"path": Path(path).name, "sha256": file_sha256(path)} for name, path in outputs.items()}
    parent_entries = [parent_entry(p) for p in parents]
    cfg_hash = config_hash(config, exclude)
    identity = json.dumps(
        {
            "outputs": {k: v["sha256"] for k, v in hashed_outputs.items()},
            "parents": [p["sha256"] for p in parent_entries],
            "config": cfg_hash,
        },
        sort_keys=True,
    )
    manifest = {
        "kind": kind,
        "dataset_id": hashlib.sha256(identity.encode("utf-8")).hexdigest()[:16],
        "content_hash": hashed_outputs[next(iter(hashed_outputs))]["sha256"],
        "outputs": hashed_outputs,
        "parents": parent_entries,
        "config_hash": cfg_hash,
        "config": config.model_dump(mode="json"),
        "funnel": funnel,
        "posttrain_version": __version__,
    }
    Path(output_dir, "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", "utf-8")
    return manifest
