"""Read and write record files: JSONL (also ``.json`` lines or a JSON array, ``.gz`` too), Parquet, and
directories written by ``datasets.Dataset.save_to_disk``.

This is the one JSONL reader and writer of the package. Every JSON line anyone reads is decoded by
``parse_json_line`` (UTF-8 per line, JSON, one object; a bad line becomes a ``BadLine`` with a
reason and a category, never an exception), and every JSONL file anyone writes goes through
``jsonl_writer`` / ``write_jsonl`` (atomic replace on local disk) or ``append_jsonl`` — written by
``posttrain.data.writers`` and re-exported here; ``write_records`` (JSONL or Parquet by suffix) is below.

Bad input never crashes without a message and never disappears. Each bad record (malformed JSON,
invalid UTF-8, a missing or mistyped field, an empty message, identical chosen/rejected, a record of
the wrong kind, …) either stops the read with ``DataError`` naming ``file:line``, the field and the
reason (``on_error="raise"``, the default), or is appended to a quarantine JSONL file with its reason
and the read goes on (``on_error="quarantine"``). The ``ReadReport`` always adds up:
``read == accepted + quarantined``. For Parquet files and saved datasets, "line" is the 1-based row.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

from posttrain.data.errors import DataError
from posttrain.data.formats import (
    BLANK_LINE,
    FORMATS,
    INVALID_UTF8,
    MALFORMED_JSON,
    NOT_AN_OBJECT,
    FormatError,
    convert,
    detect_format,
    record_to_raw,
)
from posttrain.data.lines import (  # iter_lines, iter_text_lines: the package reads every line through this module
    MAX_RECORD_BYTES,
    LineTooLong,
    iter_chunks,
    iter_lines,
    iter_text_lines,  # noqa: F401 - re-exported
    read_all,
)
from posttrain.data.read_report import ReadReport
from posttrain.data.records import RECORD_KINDS, Record
from posttrain.data.shards import is_glob, list_shards, rank_and_world, read_shards
from posttrain.data.storage import (
    AtomicFile,
    filesystem,
    is_plain_local,
    is_remote,
    not_found,
    path_exists,
    path_isdir,
    storage_errors,
)
from posttrain.data.writers import (  # JsonlWriter, jsonl_writer: re-exported, callers write through this module
    JsonlWriter,  # noqa: F401 - re-exported
    append_jsonl,
    json_line,
    jsonl_writer,  # noqa: F401 - re-exported
    write_jsonl,
)
from posttrain.progress import progress as progress_bar

logger = logging.getLogger("posttrain.data")

OnError = Literal["raise", "quarantine"]
Layout = Literal["lines", "rows"]
_COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst"}
LINE_SUFFIXES = (".jsonl", ".ndjson")
RECORD_SUFFIXES = (*LINE_SUFFIXES, ".json", ".parquet")


@dataclass
class BadLine:
    """A line (or array element) that could not be parsed into a JSON object: why, and its text."""

    reason: str
    category: str  # one of posttrain.data.formats.CATEGORIES
    raw: str


# ------------------------------------------------------------------------------------------ sources


def _suffix(path: str) -> str:
    suffixes = [s.lower() for s in PurePosixPath(path).suffixes]
    while suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def json_syntax_error(text: str, exc: json.JSONDecodeError) -> tuple[int, str]:
    """``(line, reason)`` for a JSON syntax error in ``text``: 1-based line, the column relative to that line.

    When the text simply stops too early (the error sits at its end, or a string never closes) the place
    to look at in a truncated file is where the content ends, so that is the position given (the column
    just after the last character, as json counts); ``json`` itself points at the start of the open
    string, or at column 1 of the empty line after the content.
    """
    end = len(text.rstrip())
    unterminated = exc.msg.startswith("Unterminated string")
    if exc.pos < end and not unterminated:
        return exc.lineno, f"malformed JSON: {exc.msg} (column {exc.colno})"
    line = text.count("\n", 0, end) + 1
    column = end - (text.rfind("\n", 0, end) + 1) + 1
    what = "an unterminated string" if unterminated else exc.msg.lower()
    opened = ""
    if unterminated:
        of_line = f" of line {exc.lineno}" if exc.lineno != line else ""
        opened = f"; the string starts at column {exc.colno}{of_line}"
    return line, (f"malformed JSON: {what}: the text ends before the JSON is complete, at column {column}{opened} "
                  "(truncated?)")


def parse_json_line(data: bytes) -> dict | BadLine:
    """One JSON line (bytes, line ending optional) → its object, or a ``BadLine`` saying what is wrong.

    Blank lines, invalid UTF-8, malformed JSON (including nesting too deep to parse), lone UTF-16
    surrogates from ``\\u`` escapes (not text: they cannot be written back as UTF-8) and values that are
    not objects each get their own category.
    """
    try:
        text = data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        shown = data.decode("utf-8", errors="backslashreplace").rstrip("\r\n")
        return BadLine(f"invalid UTF-8 at byte {exc.start} of the line", INVALID_UTF8, shown)
    if not text or text.isspace():  # what `not text.strip()` says, without copying the text
        return BadLine("blank line", BLANK_LINE, text)
    try:
        value = _loads(text)
    except json.JSONDecodeError as exc:
        return BadLine(json_syntax_error(text, exc)[1], MALFORMED_JSON, text)
    except RecursionError:
        return BadLine("malformed JSON: nested too deeply to parse", MALFORMED_JSON, text)
    if not isinstance(value, dict):
        return BadLine(f"expected a JSON object, got {type(value).__name__}", NOT_AN_OBJECT, text)
    # Valid UTF-8 cannot hold a lone surrogate, but a JSON escape (\ud800) can; look only when one may be there.
    if ("\\ud" in text or "\\uD" in text) and not _encodable(value):  # JSON escapes are `\u`, in either hex case
        return BadLine("a \\u escape holds a lone surrogate (not valid Unicode text)", INVALID_UTF8, text)
    return value


_SCAN = json.JSONDecoder().scan_once  # what json.loads runs, without its two Python layers (a third of its time)


def _loads(text: str) -> Any:
    """``json.loads(text)``: the decoder's C scanner at once when the value fills the text (a JSON line without
    surrounding blanks), else ``json.loads`` itself, which also raises its own errors in its own words."""
    try:
        value, end = _SCAN(text, 0)
    except (StopIteration, ValueError, RecursionError):
        end = -1
    return value if end == len(text) else json.loads(text)


def _encodable(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _iter_json_lines(path: str, max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple[int, dict | BadLine]]:
    for number, data in iter_lines(path, max_record_bytes):
        if isinstance(data, LineTooLong):
            # Counted with the lines that do not parse (as one nested too deeply is): the categories are
            # fixed, curation maps each to a funnel reason. The reason says what happened.
            yield number, BadLine(data.reason, MALFORMED_JSON, data.head.decode("utf-8", errors="backslashreplace")
                                  + f"… ({data.size} bytes)")
        else:
            yield number, parse_json_line(data)


def _iter_json_array(path: str, text: str) -> Iterator[tuple[int, dict | BadLine]]:
    decoder = json.JSONDecoder()
    position = text.index("[") + 1

    def skip_space(at: int) -> int:
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
        return at

    position = skip_space(position)
    if position < len(text) and text[position] == "]":
        return
    while True:
        line, start = text.count("\n", 0, position) + 1, position
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            # Past a syntax error the element boundaries are unknown, so the rest cannot be read.
            error_line, reason = json_syntax_error(text, exc)
            raise DataError(path, error_line, None, f"{reason}; a JSON array cannot be read past a syntax "
                            "error") from None
        if isinstance(value, dict):
            if "\\ud" in text[start:position].lower() and not _encodable(value):
                yield line, BadLine("a \\u escape holds a lone surrogate (not valid Unicode text)", INVALID_UTF8,
                                    json.dumps(value))
            else:
                yield line, value
        else:
            yield line, BadLine(f"expected a JSON object, got {type(value).__name__}", NOT_AN_OBJECT,
                                json.dumps(value))
        position = skip_space(position)
        if position < len(text) and text[position] == ",":
            position = skip_space(position + 1)
            continue
        if position < len(text) and text[position] == "]":
            return
        if position >= len(text.rstrip()):  # the file stops after an element, before its `]`
            end_line, reason = json_syntax_error(text, json.JSONDecodeError("the JSON array is not closed", text, position))
            raise DataError(path, end_line, None, reason)
        line = text.count("\n", 0, position) + 1
        raise DataError(path, line, None, "malformed JSON: expected ',' or ']' in the JSON array")


def _is_json_array(path: str) -> bool:
    """A ``.json`` file is either JSON lines or one JSON array of objects (common for Alpaca data)."""
    return read_all(path, 4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def _iter_json_array_file(path: str) -> Iterator[tuple[int, dict | BadLine]]:
    data = read_all(path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(path, data.count(b"\n", 0, exc.start) + 1, None,
                        "invalid UTF-8 in a JSON array file (the file cannot be read)") from None
    yield from _iter_json_array(path, text)


def _iter_parquet(path: str) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    row = 0
    import fsspec

    with fsspec.open(path, "rb") as handle:
        for batch in pq.ParquetFile(handle).iter_batches(batch_size=1024):
            for item in batch.to_pylist():
                row += 1
                yield row, item


def _iter_saved_dataset(path: str) -> Iterator[tuple[int, dict]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{path}: reading a saved HF dataset needs `datasets`: "
                          "pip install 'posttrain[datasets]'") from None
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if len(splits) != 1:
            raise DataError(path, None, None, f"a saved DatasetDict with splits {splits}; point at one split, "
                            f"e.g. {path.rstrip('/')}/{splits[0]}")
        loaded = loaded[splits[0]]
    yield from enumerate(loaded, start=1)


def is_record_source(path: str) -> bool:
    """Whether ``path`` names something ``read_records`` reads: a record file suffix, a directory or a glob."""
    if is_glob(str(path)):
        return True
    fs, local = filesystem(str(path))
    with storage_errors(str(path)):
        return _suffix(str(path)) in RECORD_SUFFIXES or fs.isdir(local)


def _kind_of_source(path: str) -> str:
    if path_isdir(path):
        return "dataset"
    if not path_exists(path):
        raise not_found(path)
    suffix = _suffix(path)
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".json":
        return "json_array" if _is_json_array(path) else "json_lines"
    if suffix in LINE_SUFFIXES:
        return "json_lines"
    raise DataError(path, None, None, f"unsupported file type {suffix or '(no suffix)'!r}; expected .jsonl, "
                    ".json, .parquet (optionally .gz) or a directory saved by datasets.save_to_disk")


def source_layout(path: str) -> Layout:
    """``"lines"`` for JSON lines (one record per text line: ``iter_lines`` reads them), ``"rows"`` for
    Parquet, saved datasets and JSON arrays. ``FileNotFoundError`` / ``DataError`` as ``iter_raw_records``."""
    return "lines" if _kind_of_source(str(path)) == "json_lines" else "rows"


def iter_raw_records(path: str, max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple[int, dict | BadLine]]:
    """``(line, object or BadLine)`` for every line, row or array element of one record file (or saved
    dataset), blank lines included (as ``BLANK_LINE``); a JSON line of more than ``max_record_bytes`` is a
    ``BadLine``, skipped unread. Raises ``FileNotFoundError``, or ``DataError`` for an unsupported file type
    or a JSON array past a syntax error. ``read_records`` also reads shard sets (``posttrain.data.shards``)."""
    path = str(path)
    kind = _kind_of_source(path)
    if kind == "dataset":
        return _iter_saved_dataset(path)
    if kind == "parquet":
        return _iter_parquet(path)
    if kind == "json_array":
        return _iter_json_array_file(path)
    return _iter_json_lines(path, max_record_bytes)


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def is_plain_jsonl(path: str) -> bool:
    """A local, uncompressed JSON-lines file: a reader may split it by byte offset (``to_plain_jsonl`` makes one)."""
    path = str(path)
    if is_plain_local(path) and os.path.splitext(path)[1].lower() in LINE_SUFFIXES:
        return source_layout(path) == "lines"  # no compression has a JSON-lines suffix: fsspec need not be asked
    from fsspec.utils import infer_compression

    fs, _ = filesystem(path)
    return _is_local(fs) and infer_compression(path) is None and source_layout(path) == "lines"


def to_plain_jsonl(path: str, target: str) -> Iterator[tuple[int, int]]:
    """Copy any record source to ``target`` as plain JSON lines, one line per input line, row or array
    element; yield ``(source line, bytes written)`` for each. JSON-lines sources are copied byte for byte
    in chunks, however long a line is (a bad line stays bad, for the reader of ``target`` to report; a
    missing last line ending is added); rows are written as JSON."""
    path = str(path)
    with open(target, "wb") as out:
        if source_layout(path) == "lines":
            number = size = 0  # size: bytes of the current line written so far
            for chunk in iter_chunks(path):
                out.write(chunk)
                start = 0
                while (end := chunk.find(b"\n", start)) >= 0:
                    number += 1
                    yield number, size + end + 1 - start
                    size, start = 0, end + 1
                size += len(chunk) - start
            if size:
                out.write(b"\n")
                yield number + 1, size + 1
            return
        for number, item in iter_raw_records(path):
            if isinstance(item, BadLine):
                data = item.raw.encode("utf-8", errors="backslashreplace") + b"\n"
            else:
                try:
                    data = json_line(item).encode("utf-8")
                except UnicodeEncodeError:  # a lone surrogate from a JSON array: escaped, the reader rejects it
                    data = (json.dumps(item, default=str) + "\n").encode("ascii")
            out.write(data)
            yield number, len(data)


def iter_jsonl(path: str, max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, object)`` for each non-blank line; raise ``DataError`` on a malformed line or
    one of more than ``max_record_bytes``."""
    for number, item in _iter_json_lines(str(path), max_record_bytes):
        if isinstance(item, BadLine):
            if item.category == BLANK_LINE:
                continue
            raise DataError(str(path), number, None, item.reason)
        yield number, item


def read_jsonl(path: str) -> list[dict]:
    """Every object of a JSONL file (local or fsspec URL), in order; ``DataError`` on a malformed line."""
    return [item for _, item in iter_jsonl(str(path))]


# ------------------------------------------------------------------------------------------ reading


@dataclass
class _ShardRead:
    """What reading one file of a source gave: its records, its report and the bad records to quarantine."""

    records: list[Record]
    report: ReadReport
    bad: list[dict[str, Any]]
    complete: bool = True  # False: stopped at ``limit`` records


def _read_shard(path: str, kind: str | None, fmt: str, on_error: OnError, keep_bad: bool,
                progress: bool, max_record_bytes: int, limit: int | None = None) -> _ShardRead:
    report, records, bad = ReadReport(path=path, kind=kind), [], []
    rows = progress_bar(iter_raw_records(path, max_record_bytes), desc=f"reading {PurePosixPath(path).name}",
                        unit="rec", disable=not progress)
    for line, item in rows:
        if isinstance(item, BadLine) and item.category == BLANK_LINE:
            report.blank_lines += 1  # holds no record: not counted as read
            continue
        if limit is not None and report.read >= limit:
            return _ShardRead(records, report, bad, complete=False)
        report.read += 1
        try:
            if isinstance(item, BadLine):
                raise FormatError(None, item.reason, item.category)
            record, used = convert(item, fmt, kind)
        except FormatError as exc:
            error = DataError(path, line, exc.field, exc.reason)
            if on_error == "raise":
                raise error from None
            detected = _detected_format(item, fmt)
            if detected:
                report.detected[detected] += 1
            report.add_bad(exc.category, line, f"`{exc.field}`: {exc.reason}" if exc.field else exc.reason)
            if keep_bad:
                bad.append({"file": path, "line": line, "field": error.field, "reason": error.reason,
                            "raw": item.raw if isinstance(item, BadLine) else item})
            continue
        report.accepted += 1
        report.formats[used] += 1
        report.detected[used] += 1
        report.kinds[record.kind] += 1
        records.append(record)
    rows.close()  # only a finished read reports "done"
    return _ShardRead(records, report, bad)


def read_records(
    path: str,
    kind: str | None = None,
    fmt: str = "auto",
    on_error: OnError = "raise",
    quarantine_path: str | None = None,
    progress: bool = True,
    split_across_ranks: bool = False,
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> tuple[list[Record], ReadReport]:
    """Read every record of ``path``; return the good ones and a ``ReadReport``.

    ``path`` is a record file, a saved HF dataset, or a shard set (a directory or glob of record files,
    local or ``s3://…``: ``posttrain.data.shards``), read in sorted name order as one dataset; errors and
    quarantine entries name the shard file and its line. ``kind`` (``"sft"``, ``"preference"``, ``"rl"``)
    makes records of another kind errors. ``fmt`` forces a format instead of detecting it per record. With
    ``on_error="quarantine"`` bad records are appended to ``quarantine_path`` as ``{"file", "line", "field",
    "reason", "raw"}`` and the read goes on; with ``quarantine_path=None`` they are only counted in the
    report. ``split_across_ranks`` (every rank calls it, under torchrun) reads rank r's share of the shards
    on rank r and exchanges the records, so every rank returns the same list; rank 0 alone writes the
    quarantine file. A JSON line of more than ``max_record_bytes`` (``data.max_record_bytes``) is a bad
    record, skipped to its end without being held. The report's summary is logged at the end
    (``posttrain.data`` logger; a warning when anything was quarantined).
    """
    path = str(path)
    if kind is not None and kind not in RECORD_KINDS:
        raise ValueError(f"unknown record kind {kind!r}; expected one of {', '.join(RECORD_KINDS)}")
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected 'auto' or one of {', '.join(FORMATS)}")
    if on_error not in ("raise", "quarantine"):
        raise ValueError(f"on_error must be 'raise' or 'quarantine', got {on_error!r}")
    report = ReadReport(path=path, quarantine_path=quarantine_path if on_error == "quarantine" else None, kind=kind)
    keep_bad = report.quarantine_path is not None
    with storage_errors(path):
        parts = read_shards(
            path, lambda shard: _read_shard(shard, kind, fmt, on_error, keep_bad, progress, max_record_bytes),
            split_across_ranks)
    records: list[Record] = []
    bad: list[dict[str, Any]] = []
    for shard, part in parts:
        report.merge(part.report, PurePosixPath(shard).name if len(parts) > 1 else None)
        records += part.records
        bad += part.bad
    if bad and (not split_across_ranks or _is_first_rank()):
        append_jsonl(report.quarantine_path, bad)
    assert report.read == report.accepted + report.quarantined, report.summary()
    # Quarantined records are a warning, so they show even where nobody configured logging.
    logger.log(logging.WARNING if report.quarantined else logging.INFO, report.summary())
    return records, report


# Records ``peek_records`` reads at most: a few tenths of a second, before a run writes or loads anything.
PEEK_RECORDS = 10_000


@dataclass
class Peek:
    """What ``peek_records`` saw: the first records, their report, and whether that was the whole source."""

    records: list[Record]
    report: ReadReport
    complete: bool


def peek_records(path: str, kind: str | None = None, fmt: str = "auto", on_error: OnError = "raise",
                 max_record_bytes: int = MAX_RECORD_BYTES) -> Peek | None:
    """The first ``PEEK_RECORDS`` records of a local source, read as ``read_records`` reads them, writing nothing
    (no quarantine file); None for a remote source (its listing and download are left to the one full read).

    What it raises, the full read raises too: a missing file, an unsupported type, and under ``on_error="raise"``
    the first bad record (it is the first one). ``complete`` says the whole source was read, so a rule over all
    records (``ReadReport.check_usable``, a curriculum's tiers) decides here as it would there.
    """
    path = str(path)
    if is_remote(path):
        return None
    report, records, left = ReadReport(path=path, kind=kind), [], PEEK_RECORDS
    with storage_errors(path):
        shards = list_shards(path)
        for shard in shards:
            part = _read_shard(shard, kind, fmt, on_error, False, False, max_record_bytes, limit=left)
            report.merge(part.report, PurePosixPath(shard).name if len(shards) > 1 else None)
            records += part.records
            left -= part.report.read
            if not part.complete:
                return Peek(records, report, complete=False)
    return Peek(records, report, complete=True)


def _is_first_rank() -> bool:
    return rank_and_world()[0] == 0


def _detected_format(item: dict | BadLine, fmt: str) -> str | None:
    """The format a refused record was recognised as (None for lines that are not records, or no known format)."""
    if isinstance(item, BadLine):
        return None
    if fmt != "auto":
        return fmt
    try:
        return detect_format(item)
    except FormatError:
        return None


# ------------------------------------------------------------------------------------------ writing


def _parquet_row(record: Record) -> dict[str, Any]:
    row = record_to_raw(record)
    # Parquet needs one type per column; free-form meta would not have one, so it is stored as JSON text
    # (read back transparently by formats.to_record).
    if "meta" in row:
        row["meta"] = json.dumps(row["meta"], ensure_ascii=False, sort_keys=True)
    return row


def write_records(path: str, records: Iterable[Record]) -> None:
    """Write records to ``.jsonl`` (``.jsonl.gz``) or ``.parquet`` by suffix, in full or not at all (local
    path or object-store URL); ``read_records`` reads them back."""
    path = str(path)
    suffix = _suffix(path)
    if suffix in LINE_SUFFIXES:
        write_jsonl(path, (record_to_raw(record) for record in records))
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [_parquet_row(record) for record in records]
        # from_pylist takes its columns from the first row; mixed kinds need the union of all keys.
        columns = list(dict.fromkeys(key for row in rows for key in row))
        table = pa.Table.from_pylist([{key: row.get(key) for key in columns} for row in rows])
        with AtomicFile(path, "wb") as handle:
            pq.write_table(table, handle)
    else:
        raise DataError(path, None, None, f"cannot write {suffix or '(no suffix)'!r}; use .jsonl or .parquet")
