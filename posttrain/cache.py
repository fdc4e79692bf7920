"""What posttrain keeps on the side and can always recompute: ``$XDG_CACHE_HOME/posttrain/<name>``.

The digest cache here remembers content hashes by file status. A run's identity (``posttrain.train.identity``)
and the reference log-prob cache key hash the model's weight files, and a resume fingerprints every local data
shard: for a 70B model (140 GB) or a large local dataset that is minutes of reading on every start and every
restart after a preemption, on rank 0 while the others wait. A file whose device, inode, size and modification
time (ns) are those it had when it was hashed has the same content, the rule ``make``, git's index and rsync's
quick check rely on, so its digest is looked up instead.

What the rule does not see is a write that leaves all four as they were: an in-place edit that restores the
modification time on purpose, or one within the file system's timestamp tick of the hash. The second is
excluded here as git excludes it: a file modified within ``RACY_S`` seconds of being hashed is not cached, and
neither is one whose status changed while it was read. Integrity checks (a checkpoint's files against its
manifest) never use this cache: bit rot changes content without changing the status.
Delete ``$XDG_CACHE_HOME/posttrain/digests`` to force every hash to be recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RACY_S = 2.0  # coarser than any file system's mtime tick (ext4: a jiffy; FAT: 2 s)


def cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/posttrain/<name>`` (``~/.cache/posttrain/<name>``); not created."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posttrain" / name


def _status(paths: Sequence[Path]) -> list[list]:
    out = []
    for path in paths:
        info = os.stat(path)
        # The name as given (a link's own name, not its target's) and the status of what it points to.
        out.append([os.path.abspath(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns])
    return out


def stat_cached_digest(kind: str, paths: Sequence[str | os.PathLike], compute: Callable[[], str]) -> str:
    """``compute()`` — a digest of the contents of ``paths`` — or the value it gave for the same ``kind`` when
    every one of those files had the status it has now (see the module docstring)."""
    paths = [Path(p) for p in paths]
    before = _status(paths)
    key = hashlib.sha256(json.dumps([kind, before]).encode()).hexdigest()
    entry = cache_dir("digests") / key[:2] / key
    try:
        cached = entry.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        cached = ""
    if cached:
        return cached
    value = compute()
    newest_mtime_s = max((status[4] for status in before), default=0) / 1e9
    if time.time() - newest_mtime_s > RACY_S and _status(paths) == before:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            staging = entry.with_name(f"{key}.{os.getpid()}.tmp")
            staging.write_text(value, encoding="ascii")
            os.replace(staging, entry)  # readers see the whole digest or none
        except OSError:
            pass  # an unwritable cache only costs the next start another read
    return value
