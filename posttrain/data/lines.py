"""The lines of a text file (local or fsspec URL, compressed or not), read in bounded chunks.

No line is ever held whole past ``max_record_bytes``: a file is read ``READ_CHUNK`` bytes at a time and
a line longer than the bound is skipped to its end, keeping only its first ``LINE_HEAD_BYTES`` for the
report (``LineTooLong``). Iterating a file object instead (``for line in handle``) holds a line whole,
so one 3 GB line in a ``.jsonl.gz`` ends the process with MemoryError before any check runs.
``posttrain.data.io`` turns ``LineTooLong`` into a bad record; this module only reads bytes.
"""

from __future__ import annotations

import lzma
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from posttrain.data.errors import DataError

MAX_RECORD_BYTES = 64 * 2**20  # the default of data.max_record_bytes (posttrain.config.sections.DataConfig)
READ_CHUNK = 2**20
LINE_HEAD_BYTES = 1024  # what a report keeps of a line it did not read: enough to recognise it by


@dataclass
class LineTooLong:
    """A line of more than ``limit`` bytes (line ending excluded), read and dropped: its length and start."""

    size: int
    limit: int
    head: bytes

    @property
    def reason(self) -> str:
        return f"record of more than {self.limit} bytes ({self.size} bytes), over data.max_record_bytes"


def split_lines(handle: IO[bytes], max_bytes: int) -> Iterator[bytes | LineTooLong]:
    """Each line of a binary stream, ``\\n`` removed, or a ``LineTooLong`` for one of more than ``max_bytes``.

    Reads ``handle.read(READ_CHUNK)`` only (not ``readline``: fsspec's remote files ignore its size
    limit), so at most about ``max_bytes + READ_CHUNK`` bytes are held at any time.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    pending: list[bytes] = []  # the start of the current line, within the bound
    held = 0
    skipped: LineTooLong | None = None  # the current line went over the bound: only its length is counted

    def too_long(piece: bytes) -> LineTooLong:
        head = (b"".join(pending) + piece[:LINE_HEAD_BYTES])[:LINE_HEAD_BYTES]
        return LineTooLong(held + len(piece), max_bytes, head)

    while chunk := handle.read(READ_CHUNK):
        *ends, tail = chunk.split(b"\n")
        for end in ends:  # each completes a line
            if skipped is not None:
                skipped.size += len(end)
                yield skipped
            elif held + len(end) > max_bytes:
                yield too_long(end)
            else:
                yield b"".join(pending) + end if pending else end
            pending, held, skipped = [], 0, None
        if skipped is not None:
            skipped.size += len(tail)
        elif held + len(tail) > max_bytes:
            skipped, pending, held = too_long(tail), [], 0
        elif tail:
            pending.append(tail)
            held += len(tail)
    if skipped is not None:
        yield skipped
    elif pending:  # the last line has no line ending
        yield b"".join(pending)


# What decompressors raise for a truncated or damaged stream (gzip: EOFError, BadGzipFile, zlib.error; bz2:
# EOFError, OSError; xz: LZMAError). An OSError with an errno is a real I/O error and is left alone.
_DECOMPRESSION_ERRORS = (EOFError, zlib.error, lzma.LZMAError, OSError)


def _damaged_stream(path: str, exc: BaseException, lines: int) -> DataError | None:
    """A one-line ``DataError`` for a compressed file that ends early or is corrupt; None for other errors."""
    from fsspec.utils import infer_compression

    compression = infer_compression(str(path))
    if compression is None or (isinstance(exc, OSError) and exc.errno is not None):
        return None
    after = f" after {lines} complete line{'s' if lines != 1 else ''}" if lines else ""
    check = f" (`gzip -t {path}` checks it)" if compression == "gzip" else ""
    return DataError(str(path), None, None, f"the {compression}-compressed file is truncated or corrupt{after} "
                     f"({type(exc).__name__}: {exc}); it cannot be read to the end: re-create or re-download "
                     f"it{check}")


def iter_lines(path: str, max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple[int, bytes | LineTooLong]]:
    """``(line_number, bytes)`` of each line of a text file (local or fsspec URL, compression by suffix),
    line ending removed, a leading UTF-8 BOM dropped; ``(line_number, LineTooLong)`` for a line of more
    than ``max_record_bytes``, which is never held whole. Bytes, so one bad byte spoils one line, not the
    file. A truncated or corrupt compressed file raises ``DataError``."""
    import fsspec  # here, not at the top: splitting a local file by offset (curation) needs none of it

    number = 0
    try:
        with fsspec.open(str(path), "rb", compression="infer") as handle:
            for number, data in enumerate(split_lines(handle, max_record_bytes), start=1):
                if isinstance(data, bytes):
                    if number == 1 and data.startswith(b"\xef\xbb\xbf"):
                        data = data[3:]
                    if data.endswith(b"\r"):
                        data = data[:-1]
                yield number, data
    except _DECOMPRESSION_ERRORS as exc:
        # `number` lines were read whole before the stream broke (the one being read is lost).
        error = _damaged_stream(path, exc, number)
        if error is None:
            raise
        raise error from None


def iter_text_lines(path: str, max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple[int, str]]:
    """``(line_number, text)`` of each non-blank line of a plain-text file (``iter_lines`` decoded); a line
    that is not UTF-8, or is longer than ``max_record_bytes``, raises ``DataError`` naming file and line."""
    for number, data in iter_lines(path, max_record_bytes):
        if isinstance(data, LineTooLong):
            raise DataError(path, number, None, data.reason)
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(path, number, None, f"invalid UTF-8 at byte {exc.start} of the line") from None
        if line.strip():
            yield number, line


def iter_chunks(path: str) -> Iterator[bytes]:
    """The (decompressed) bytes of a file in chunks of at most ``READ_CHUNK``, a leading UTF-8 BOM dropped;
    ``DataError`` for a damaged compressed file."""
    import fsspec

    first = True
    try:
        with fsspec.open(str(path), "rb", compression="infer") as handle:
            while chunk := handle.read(READ_CHUNK):
                if first and chunk.startswith(b"\xef\xbb\xbf"):
                    chunk = chunk[3:]
                first = False
                yield chunk
    except _DECOMPRESSION_ERRORS as exc:
        error = _damaged_stream(path, exc, 0)
        if error is None:
            raise
        raise error from None


def read_all(path: str, size: int = -1) -> bytes:
    """The (decompressed) bytes of a file, or its first ``size``; ``DataError`` for a damaged compressed file."""
    import fsspec

    try:
        with fsspec.open(path, "rb", compression="infer") as handle:
            return handle.read(size)
    except _DECOMPRESSION_ERRORS as exc:
        error = _damaged_stream(path, exc, 0)
        if error is None:
            raise
        raise error from None

