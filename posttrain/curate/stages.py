"""The stage list, how it splits into segments, and the per-shard work a worker does.

Stages run in this order: normalize, filters, exact_dedup, near_dedup, semantic_dedup, verify,
judge, intent, difficulty. *Row stages* decide each record alone (``apply(rows) -> [Drop | None]``).
*Global stages* (the dedups) need every record: a worker computes compact ``features(rows)`` and
the parent ``decide``s. So the list is cut into *segments* at each run of global stages: a worker
runs a segment's row stages on one shard, computes the features of the global stages that follow,
and writes the survivors to a file; the parent decides; the next segment starts by applying those
decisions. Memory per worker is bounded by the shard size.
"""

from __future__ import annotations

import heapq
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from posttrain.curate.config import CurateRecipe
from posttrain.curate.dedup import Decisions
from posttrain.curate.rows import Drop, Row, parse_line, row_from_json, row_to_json, unparsed_dropped_record

PARSE = "parse"
STAGE_ORDER = (
    "normalize", "filters", "exact_dedup", "near_dedup", "semantic_dedup", "verify", "judge", "intent", "difficulty",
)  # fmt: skip
GLOBAL_STAGES = ("exact_dedup", "near_dedup", "semantic_dedup")
MODEL_STAGES = ("judge", "intent", "difficulty")  # may load models; see Segment.runs_models


class RowStage(Protocol):
    name: str

    def apply(self, rows: list[Row]) -> list[Drop | None]: ...


class GlobalStage(Protocol):
    name: str

    def features(self, rows: list[Row], scratch: str) -> Any: ...

    def decide(self, shard_features: list[Any], alive: np.ndarray, ids: list[str]) -> Decisions: ...


def enabled_stages(config: CurateRecipe) -> list[str]:
    return [name for name in STAGE_ORDER if getattr(config, name).enabled]


def build_stage(name: str, config: CurateRecipe, cache_dir: str | None = None) -> Any:
    """Construct one stage from the recipe (imports stay local: a worker loads only what it runs)."""
    if name == "normalize":
        from posttrain.curate.normalize import NormalizeStage

        return NormalizeStage(config.normalize)
    if name == "filters":
        from posttrain.curate.filters import FilterStage

        return FilterStage(config.filters)
    if name == "exact_dedup":
        from posttrain.curate.dedup import ExactDedupStage

        return ExactDedupStage(config.exact_dedup)
    if name == "near_dedup":
        from posttrain.curate.dedup import NearDedupStage

        return NearDedupStage(config.near_dedup)
    if name == "semantic_dedup":
        from posttrain.curate.dedup import SemanticDedupStage

        return SemanticDedupStage(config.semantic_dedup, config.embedding)
    if name == "verify":
        from posttrain.curate.verify import VerifyStage

        return VerifyStage()
    if name == "judge":
        from posttrain.curate.judge import JudgeStage

        cache = Path(cache_dir, "judge.jsonl") if cache_dir else None
        return JudgeStage(config.judge, list(config.intent.labels), cache)
    if name == "intent":
        from posttrain.curate.intent import IntentStage

        return IntentStage(config.intent, config.embedding)
    if name == "difficulty":
        from posttrain.curate.difficulty import DifficultyStage

        return DifficultyStage(config.difficulty)
    raise KeyError(f"unknown curation stage {name!r}; stages: {', '.join(STAGE_ORDER)}")


# One set of stage objects per process: models load once, not once per shard.
_STAGE_CACHE: dict[tuple[str, str, str | None], Any] = {}


def cached_stage(name: str, config: CurateRecipe, cache_dir: str | None) -> Any:
    key = (name, config.model_dump_json(), cache_dir)
    if key not in _STAGE_CACHE:
        _STAGE_CACHE[key] = build_stage(name, config, cache_dir)
    return _STAGE_CACHE[key]


@dataclass
class Segment:
    index: int
    row_stages: list[str]
    global_stages: list[str]  # features computed at the end of this segment, decided by the parent
    final: bool

    @property
    def runs_models(self) -> bool:
        return any(name in MODEL_STAGES for name in self.row_stages)


def plan_segments(stages: list[str]) -> list[Segment]:
    segments: list[Segment] = []
    rows: list[str] = []
    globals_: list[str] = []
    for name in stages:
        if name in GLOBAL_STAGES:
            globals_.append(name)
            continue
        if globals_:  # a row stage after global stages starts a new segment
            segments.append(Segment(len(segments), rows, globals_, final=False))
            rows, globals_ = [], []
        rows.append(name)
    segments.append(Segment(len(segments), rows, globals_, final=not globals_))
    if globals_:  # the list ended on global stages: one more segment applies their decisions
        segments.append(Segment(len(segments), [], [], final=True))
    return segments


@dataclass
class ShardSource:
    path: str
    start: int  # byte offsets of the shard in the file
    end: int
    first_line: int  # 1-based line number of the first line
    first_index: int  # position of the first line in the whole input


@dataclass
class ShardTask:
    shard: int
    segment: Segment
    config: CurateRecipe
    work_dir: str
    cache_dir: str | None
    source: ShardSource | None = None  # first segment: read raw lines
    rows_path: str | None = None  # later segments: the previous segment's survivors
    decisions: list[tuple[str, Decisions]] = field(default_factory=list)  # local positions


@dataclass
class ShardResult:
    shard: int
    counts: dict[str, tuple[int, int, dict[str, int]]]
    ids: list[str]
    features: dict[str, Any]
    rows_path: str
    dropped_path: str
    seconds: float


def read_shard_lines(source: ShardSource) -> list[bytes]:
    with open(source.path, "rb") as handle:
        handle.seek(source.start)
        data = handle.read(source.end - source.start)
    lines = data.split(b"\n")
    if lines and lines[-1] == b"" and data.endswith(b"\n"):
        lines.pop()
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def run_shard(task: ShardTask) -> ShardResult:
    """One segment on one shard: parse or load rows, apply decisions, run row stages, sign survivors."""
    started = time.perf_counter()
    segment = task.segment
    work = Path(task.work_dir)
    dropped_path = work / f"dropped-{segment.index:02d}-{task.shard:06d}.jsonl"
    rows_path = work / f"{'kept' if segment.final else 'rows'}-{segment.index:02d}-{task.shard:06d}.jsonl"
    counts: dict[str, tuple[int, int, dict[str, int]]] = {}
    dropped: list[tuple[int, str]] = []  # (input position, JSON), sorted before writing
    if task.source is not None:
        rows = _parse(task.source, counts, dropped)
    else:
        with open(task.rows_path, encoding="utf-8") as handle:  # type: ignore[arg-type]
            rows = [row_from_json(line) for line in handle]
    if task.decisions:
        rows = _apply_decisions(rows, task.decisions, dropped)
    for name in segment.row_stages:
        stage = cached_stage(name, task.config, task.cache_dir)
        verdicts = stage.apply(rows) if rows else []
        kept: list[Row] = []
        reasons: Counter = Counter()
        for row, verdict in zip(rows, verdicts, strict=True):
            if verdict is None:
                kept.append(row)
            else:
                reasons[verdict.reason] += 1
                write_dropped(dropped, row.index, row.dropped_record(name, verdict))
        counts[name] = (len(rows), len(kept), dict(reasons))
        rows = kept
    _save_dropped(dropped, dropped_path)
    features = {
        name: cached_stage(name, task.config, task.cache_dir).features(
            rows, str(work / f"{name}-{segment.index:02d}-{task.shard:06d}")
        )
        for name in segment.global_stages
    }
    with open(rows_path, "w", encoding="utf-8") as out:
        for row in rows:
            text = json.dumps(row.output_record(), ensure_ascii=False) if segment.final else row_to_json(row)
            out.write(text + "\n")
    return ShardResult(
        task.shard, counts, [row.id for row in rows], features, str(rows_path), str(dropped_path),
        time.perf_counter() - started,
    )  # fmt: skip


def write_dropped(dropped: list[tuple[int, str]], index: int, record: dict) -> None:
    dropped.append((index, json.dumps(record, ensure_ascii=False)))


def _save_dropped(dropped: list[tuple[int, str]], path: Path) -> None:
    """Part files carry the input position first, so the parent can merge them back into input order."""
    dropped.sort(key=lambda entry: entry[0])
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(f"{index}\t{text}\n" for index, text in dropped)


def merge_dropped(parts: list[str], target: Path) -> int:
    """Merge per-shard dropped files (each in input order) into one file in input order; streaming."""

    def entries(path: str):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                index, _, text = line.partition("\t")
                yield int(index), text

    count = 0
    with open(target, "w", encoding="utf-8") as out:
        for _, text in heapq.merge(*(entries(part) for part in parts), key=lambda entry: entry[0]):
            out.write(text)
            count += 1
    return count


def _parse(source: ShardSource, counts: dict, dropped) -> list[Row]:
    rows: list[Row] = []
    reasons: Counter = Counter()
    lines = read_shard_lines(source)
    for offset, raw in enumerate(lines):
        line = source.first_line + offset
        if not raw.strip():
            parsed: Row | tuple[Drop, str] = (Drop("blank_line"), "")
        else:
            parsed = parse_line(raw, source.first_index + offset, source.path, line)
        if isinstance(parsed, Row):
            rows.append(parsed)
        else:
            drop, text = parsed
            reasons[drop.reason] += 1
            index = source.first_index + offset
            write_dropped(dropped, index, unparsed_dropped_record(source.path, line, PARSE, drop, text))
    counts[PARSE] = (len(lines), len(rows), dict(reasons))
    return rows


def _apply_decisions(rows: list[Row], decisions: list[tuple[str, Decisions]], dropped) -> list[Row]:
    """Apply the parent's verdicts; positions index ``rows`` as the previous segment wrote them."""
    kept = []
    for position, row in enumerate(rows):
        for stage, decision in decisions:
            row.scores.update(decision.annotations.get(position, {}))
            drop = decision.drops.get(position)
            if drop is not None:
                write_dropped(dropped, row.index, row.dropped_record(stage, drop))
                break
        else:
            kept.append(row)
    return kept
