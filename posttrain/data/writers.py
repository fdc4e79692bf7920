"""Write JSON lines: a whole file replaced in one step (``write_jsonl``, ``jsonl_writer``) or rows appended
(``append_jsonl``), on local disk or in an object store. Every JSONL file the package writes goes through here
(``posttrain.data.io`` re-exports these with the readers; ``write_records`` there picks JSONL or Parquet).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from posttrain.data.json_text import TextEncoder
from posttrain.data.storage import AtomicFile, is_plain_local, is_remote, storage_errors

# json.dumps(row, ensure_ascii=False, default=str), faster; every JSONL line the package writes, and its pieces
LINE_ENCODER = TextEncoder(default=str)


def json_line(row: Any) -> str:
    """``row`` as one JSON line with its newline: ``json.dumps(row, ensure_ascii=False, default=str)``."""
    return LINE_ENCODER.encode(row) + "\n"


class JsonlWriter:
    """Writes JSON lines to ``path``; on a clean ``close()`` the file replaces ``path`` in one step.

    A reader (or a crash) never sees half a file, on local disk or in an object store
    (``posttrain.data.storage.AtomicFile``); if the ``with`` block raises, the partial file is removed and
    ``path`` is untouched. ``.gz`` and friends compress.
    """

    def __init__(self, path: str):
        self.path = str(path)
        from fsspec.utils import infer_compression

        self._file = AtomicFile(self.path, "w", infer_compression(self.path))
        self._handle = self._file.open()
        self.count = 0

    def write(self, row: Any) -> None:
        self._handle.write(json_line(row))
        self.count += 1

    def write_all(self, rows: Iterable[Any]) -> None:
        for row in rows:
            self.write(row)

    def close(self, keep: bool = True) -> None:
        if self._handle is None:
            return
        self._handle = None
        if keep:
            self._file.commit()
        else:
            self._file.abort()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(keep=exc_type is None)


def jsonl_writer(path: str) -> JsonlWriter:
    """A ``JsonlWriter`` for ``path``, for rows that arrive over time: ``with jsonl_writer(p) as out: out.write(row)``."""
    return JsonlWriter(path)


def write_jsonl(path: str, rows: Iterable[Any]) -> int:
    """Write ``rows`` as JSON lines, replacing ``path`` atomically on local disk; return how many were written."""
    with jsonl_writer(path) as out:
        out.write_all(rows)
    return out.count


def append_jsonl(path: str, rows: Iterable[Any]) -> int:
    """Append ``rows`` as JSON lines to ``path`` (created with its parent directory when missing)."""
    path = str(path)
    if not is_remote(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    count = 0
    if is_plain_local(path):
        opened = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the with below
    else:
        import fsspec

        opened = fsspec.open(path, "a", encoding="utf-8")
    with storage_errors(path), opened as handle:
        for row in rows:
            handle.write(json_line(row))
            count += 1
    return count
