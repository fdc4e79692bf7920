"""Sharded datasets: a directory or a glob of record files, read in sorted name order as one dataset.

``data.train: s3://bucket/data/train-*.parquet`` (or ``…/data/train/``, a directory of ``.jsonl`` /
``.jsonl.gz`` / ``.parquet`` files) names a shard set. ``list_shards`` expands it: a glob's matches, or a
directory's record files (names starting with ``.`` or ``_`` are skipped, like ``_SUCCESS``), sorted by
name; a single file is a set of one, and a directory saved by ``datasets.save_to_disk`` stays one source.

``read_shards`` reads a set with one function per shard and returns the results in shard order. Under
torchrun (``split_across_ranks=True``) rank r reads shards r, r+W, … and the parsed results are exchanged
(``posttrain.dist.gather_objects``), so every rank holds the same global order and the loop's data position
stays rank-independent: a run resumes on any number of ranks. The split starts at ``SPLIT_MIN_SHARDS``
shards (measured in ``benchmarks/README.md``: below that, one rank reading everything is as fast as the
exchange); a failure on any rank is raised on every rank, the first in shard order, so no rank waits
for a peer that gave up.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from posttrain.data.storage import filesystem, is_plain_local, not_found, storage_errors

T = TypeVar("T")
GLOB_CHARS = "*?["
# Suffixes of shard files found in a directory (the last suffix may be a compression, e.g. train-0.jsonl.gz).
SHARD_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".txt")
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
# Files that mark a directory as a saved HF dataset (one source, read by datasets.load_from_disk).
SAVED_DATASET_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")
SPLIT_MIN_SHARDS = 2  # see the module docstring and benchmarks/README.md (shard_read)


def is_glob(url: str) -> bool:
    return any(char in str(url) for char in GLOB_CHARS)


def _is_shard_name(name: str) -> bool:
    base = os.path.basename(name.rstrip("/")).lower()
    if base.startswith((".", "_")):
        return False
    for compression in _COMPRESSIONS:
        base = base.removesuffix(compression)
    return base.endswith(SHARD_SUFFIXES)


def shard_base(url: str) -> str | None:
    """The directory shard names are relative to (a glob's fixed prefix, or the directory); None for a file."""
    fs, path = filesystem(url)
    if is_glob(url):
        fixed = path[: min(path.index(char) for char in GLOB_CHARS if char in path)]
        return fixed if fixed.endswith("/") else os.path.dirname(fixed)
    return path if fs.isdir(path) else None


def list_shards(url: str) -> list[str]:
    """The files of a record source, in the order they are read (see the module docstring).

    ``FileNotFoundError`` names ``url`` when nothing is there: no such file, a glob that matches nothing,
    or a directory without record files."""
    url = str(url)
    if is_plain_local(url) and not is_glob(url) and os.path.isfile(url):
        return [url]  # one local file (as below, without importing fsspec)
    fs, path = filesystem(url)
    with storage_errors(url):
        if is_glob(url):
            matches = sorted(name for name, info in fs.glob(path, detail=True).items() if info["type"] == "file")
            if not matches:
                raise not_found(url, "no file matches this pattern")
            return [_url_of(fs, url, name) for name in matches]
        if not fs.isdir(path):
            if not fs.exists(path):
                raise not_found(url)
            return [url]
        names = {os.path.basename(entry["name"].rstrip("/")): (entry["name"], entry)
                 for entry in fs.ls(path, detail=True)}
        if any(marker in names for marker in SAVED_DATASET_MARKERS):
            return [url]
        files = sorted(name for name, info in names.values() if info["type"] == "file" and _is_shard_name(name))
        if not files:
            raise FileNotFoundError(f"{url}: the directory holds no record files (.jsonl, .json, .parquet, "
                                    "optionally compressed) and is not a dataset saved by datasets.save_to_disk")
        return [_url_of(fs, url, name) for name in files]


def _url_of(fs, url: str, name: str) -> str:
    return fs.unstrip_protocol(name) if "://" in url else name


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) when a process group is up; (0, 1) otherwise — without importing torch for it."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    from posttrain import dist

    return (dist.rank(), dist.world_size()) if dist.initialized() else (0, 1)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (it travels to the other ranks), else a RuntimeError with its text."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any pickling failure: send the message instead
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def read_shards(url: str, read_one: Callable[[str], T], split_across_ranks: bool = False) -> list[tuple[str, T]]:
    """``[(shard, read_one(shard)), …]`` in shard order, on every rank (see the module docstring)."""
    rank, world = rank_and_world() if split_across_ranks else (0, 1)
    if world == 1:
        return [(shard, read_one(shard)) for shard in list_shards(url)]
    from posttrain import dist

    listed: list[str] | BaseException | None = None
    if rank == 0:
        try:
            listed = list_shards(url)
        except Exception as exc:  # noqa: BLE001 - raised below on every rank
            listed = _portable(exc)
    listed = dist.broadcast_object(listed)  # one listing: every rank splits the same list
    if isinstance(listed, BaseException):
        raise listed
    shards: list[str] = listed
    if len(shards) < SPLIT_MIN_SHARDS:
        return [(shard, read_one(shard)) for shard in shards]
    mine: dict[int, Any] = {}
    for index in range(rank, len(shards), world):
        try:
            mine[index] = read_one(shards[index])
        except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange below
            mine[index] = _Failed(_portable(exc))
            break  # the first failure in this rank's shards; later ones cannot come first in order
    merged: dict[int, Any] = {}
    for part in dist.gather_objects(mine):
        merged.update(part)
    for index in sorted(merged):
        if isinstance(merged[index], _Failed):
            raise merged[index].error
    return [(shard, merged[index]) for index, shard in enumerate(shards)]


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error
