"""The stage list, how it splits into segments, and the per-shard work a worker does.

Stages run in this order: normalize, filters, exact_dedup, near_dedup, semantic_dedup, verify,
judge, model_judge, intent, difficulty. *Row stages* decide each record alone (``apply(rows) -> [Drop | None]``).
*Global stages* (the dedups, and the model judge's outlier test) need every record: a worker computes compact ``features(rows)`` and
the parent ``decide``s. So the list is cut into *segments* at each run of global stages: a worker
runs a segment's row stages on one shard, computes the features of the global stages that follow,
and writes the survivors to a file; the parent decides; the next segment starts by applying those
decisions. Memory per worker is bounded by the shard size.

Each stage registers a factory in ``CURATION_STAGES`` next to its class; ``STAGE_MODULES`` names
the module that does, which is imported the first time the stage is built.

Scratch files live in the run's private directory (``tempfile.mkdtemp`` in the output directory: mode 0700, an
unpredictable name, made by this process, removed at its end), are written by this run and read back once; the
rows a segment hands to the next are one pickle per shard, of builtin values only, and load through an unpickler
that resolves no class (``load_rows``), so even a file swapped in cannot run code — never a pickle for a
checkpoint or an input (docs/security.md). One pickle per shard (JSON lines cost 0.35 s more per 30k long records to
encode and decode, for nothing: no one else reads them, and the pool already pickles tasks and results);
a dropped part is JSON lines, each prefixed by the record's input position, so the parent merges the parts
in input order and copies each line as it is. The final segment's kept part is the JSON lines ``write_jsonl``
would write (``Row.output_line``). When every segment runs in this process (``executor.workers: 0``), a
``Handoff`` keeps both in memory instead, up to a budget, past which a shard goes to its file as above.
"""

from __future__ import annotations

import dataclasses
import heapq
import importlib
import operator
import pickle
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from posttrain.collector import cycle_collection_paused
from posttrain.curate.config import CurateRecipe
from posttrain.curate.dedup import Decisions
from posttrain.curate.registry import CURATION_STAGES
from posttrain.curate.rows import Drop, Row, parse_line, unparsed_dropped_record
from posttrain.data.json_text import TextEncoder
from posttrain.data.storage import AtomicFile

PARSE = "parse"
# Every stage in pipeline order, with the module that registers it (imported only when the stage runs).
STAGE_MODULES = {
    "normalize": "posttrain.curate.normalize",
    "filters": "posttrain.curate.filters",
    "exact_dedup": "posttrain.curate.dedup",
    "near_dedup": "posttrain.curate.dedup",
    "semantic_dedup": "posttrain.curate.dedup",
    "verify": "posttrain.curate.verify",
    "judge": "posttrain.curate.judge",
    "model_judge": "posttrain.curate.model_judge",
    "intent": "posttrain.curate.intent",
    "difficulty": "posttrain.curate.difficulty",
}
STAGE_ORDER = tuple(STAGE_MODULES)
GLOBAL_STAGES = ("exact_dedup", "near_dedup", "semantic_dedup", "model_judge")
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
    """Construct one stage from the recipe through ``CURATION_STAGES``, importing its module on first use."""
    if name not in CURATION_STAGES and name in STAGE_MODULES:
        importlib.import_module(STAGE_MODULES[name])
    return CURATION_STAGES.get(name)(config, cache_dir)


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
    path: str  # the plain JSON-lines file to read: the input itself, or its copy in the work directory
    start: int  # byte offsets of the shard in ``path``
    end: int
    first_line: int  # 1-based line number (row for Parquet, datasets) of the first line in ``origin``
    first_index: int  # position of the first line in the whole input
    count: int = 0  # lines in the shard
    origin: str = ""  # the input file the lines come from (``path`` when empty)
    line_numbers: list[int] | None = None  # each line's number in ``origin`` when not consecutive (JSON arrays)

    def line(self, offset: int) -> int:
        return self.line_numbers[offset] if self.line_numbers is not None else self.first_line + offset


# What a ``Handoff`` may hold at once, estimated (``rows_bytes``): a 30k-record run of long texts (42 MB of input)
# stays well inside it; a run of millions of records spills most shards to their files, as it always did.
HANDOFF_BUDGET = 512 << 20
_ROW_BYTES = 1024  # a row's objects (the Row, its dicts, the message list and dicts) besides its texts: 970 measured


class Handoff:
    """What the segments of a run in this process (``executor.workers: 0``) hand on: each shard's surviving rows
    for the next segment, then the final segment's kept part (its lines' bytes) for ``kept.jsonl``, held here
    under the path of the file they would otherwise go to. Why: writing 30k long rows to a pickle and loading them
    again, then writing the kept part and copying it into ``kept.jsonl``, was 0.3 s of a 2.8 s ``posttrain
    curate``, for nothing when the reader is this process. Why a budget: held, every shard's rows are alive at
    once, where a file holds one shard's at a time; past ``budget`` bytes a shard goes to its file (``save_rows``)
    as with a pool. A pool's workers never get one: their rows must reach another process."""

    def __init__(self, budget: int = HANDOFF_BUDGET):
        self.budget, self.held = budget, 0
        self._items: dict[str, tuple[Any, int]] = {}

    def hold(self, key: str, value: Any, size: int) -> bool:
        """Keep ``value`` (about ``size`` bytes) for ``take(key)``; False, keeping nothing, when over budget."""
        if self.held + size > self.budget:
            return False
        self._items[key] = (value, size)
        self.held += size
        return True

    def take(self, key: str) -> Any:
        """The value held under ``key`` (then no longer held), or None: it went to the file ``key``."""
        value, size = self._items.pop(key, (None, 0))
        self.held -= size
        return value


def rows_bytes(rows: list[Row]) -> int:
    """The memory ``rows`` hold, roughly: their texts' characters and a fixed amount a row."""
    return sum(len(message["content"]) for row in rows for message in row.messages) + _ROW_BYTES * len(rows)


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
    handoff: Handoff | None = None  # in this process: what the segments hand on (``Handoff``)


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
    rows_path = work / (f"kept-{segment.index:02d}-{task.shard:06d}.jsonl" if segment.final
                        else f"rows-{segment.index:02d}-{task.shard:06d}.pkl")
    counts: dict[str, tuple[int, int, dict[str, int]]] = {}
    dropped: list[tuple[int, dict]] = []  # (input position, dropped record), sorted before writing
    with cycle_collection_paused():
        rows = (_parse(task.source, counts, dropped) if task.source is not None
                else load_rows(task.rows_path, task.handoff))  # type: ignore[arg-type]  # fmt: skip
        if task.decisions:
            rows = _apply_decisions(rows, task.decisions, dropped)
    for name in segment.row_stages:  # the collector runs here: a stage may load a model, whose garbage may cycle
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
    with cycle_collection_paused():  # dicts and tuples per row again (records, lines, pickled fields)
        _save_dropped(dropped, dropped_path)
        features = {
            name: cached_stage(name, task.config, task.cache_dir).features(
                rows, str(work / f"{name}-{segment.index:02d}-{task.shard:06d}")
            )
            for name in segment.global_stages
        }
        if segment.final:  # a part, joined into kept.jsonl by the parent (atomically there): held, or a scratch file
            part = b"".join([row.output_line() for row in rows])  # one write, not one a line
            if task.handoff is None or not task.handoff.hold(str(rows_path), part, len(part)):
                with open(rows_path, "wb") as handle:
                    handle.write(part)
        else:
            save_rows(rows, rows_path, task.handoff)
    return ShardResult(
        task.shard, counts, [row.id for row in rows], features, str(rows_path), str(dropped_path),
        time.perf_counter() - started,
    )  # fmt: skip


# A row's fields in order: tuples of them pickle and load in half the time of dicts or Row objects.
_ROW_FIELDS = operator.attrgetter(*(spec.name for spec in dataclasses.fields(Row)))


def save_rows(rows: list[Row], path: str | Path, handoff: Handoff | None = None) -> None:
    """The rows a segment hands to the next: held by ``handoff`` when it has room, else one pickle of their fields
    (see the module docstring)."""
    if handoff is not None and handoff.hold(str(path), rows, rows_bytes(rows)):
        return
    with open(path, "wb") as handle:
        pickle.dump([_ROW_FIELDS(row) for row in rows], handle, protocol=pickle.HIGHEST_PROTOCOL)


class _BuiltinValuesOnly(pickle.Unpickler):
    """Reads ``save_rows``' pickle: tuples of str, int, float, bool, None, lists and dicts, which pickle without
    naming any class. Resolving none, it cannot be made to call anything, whoever wrote the file."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"curate's scratch rows hold builtin values only; refusing {module}.{name}")


def load_rows(path: str | Path, handoff: Handoff | None = None) -> list[Row]:
    """The rows ``save_rows`` held or wrote (this run's own scratch file, read without resolving any class)."""
    held = handoff.take(str(path)) if handoff is not None else None
    if held is not None:
        return held
    with open(path, "rb") as handle:
        return [Row(*fields) for fields in _BuiltinValuesOnly(handle).load()]


def write_dropped(dropped: list[tuple[int, dict]], index: int, record: dict) -> None:
    dropped.append((index, record))


_DROPPED_JSON = TextEncoder(default=str)  # as write_jsonl encodes a line: json.dumps(..., ensure_ascii=False)


def _save_dropped(dropped: list[tuple[int, dict]], path: Path) -> None:
    """A part file in input order, each line ``<input position> <record as write_jsonl writes it>``: the parent
    merges the parts by position and copies the JSON unchanged (encoded once, never decoded)."""
    dropped.sort(key=lambda entry: entry[0])
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for index, record in dropped:
            handle.write(f"{index} {_DROPPED_JSON.encode(record)}\n")


def merge_dropped(parts: list[str], target: Path) -> int:
    """Merge per-shard dropped files (each in input order) into one JSON-lines file in input order; streaming."""

    def entries(path: str):
        with open(path, "rb") as handle:
            for line in handle:
                position, _, record = line.partition(b" ")
                yield int(position), record

    count = 0
    with AtomicFile(str(target), "wb") as out:
        for _, record in heapq.merge(*(entries(part) for part in parts), key=lambda entry: entry[0]):
            out.write(record)
            count += 1
    return count


def _parse(source: ShardSource, counts: dict, dropped) -> list[Row]:
    rows: list[Row] = []
    reasons: Counter = Counter()
    lines = read_shard_lines(source)
    origin = source.origin or source.path
    for offset, raw in enumerate(lines):
        line, index = source.line(offset), source.first_index + offset
        parsed = parse_line(raw, index, origin, line)
        if isinstance(parsed, Row):
            rows.append(parsed)
        else:
            drop, text = parsed
            reasons[drop.reason] += 1
            write_dropped(dropped, index, unparsed_dropped_record(origin, line, PARSE, drop, text))
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
