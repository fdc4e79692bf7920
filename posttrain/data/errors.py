"""Errors raised for bad input data: always name the file, the line and the field."""

from __future__ import annotations


class DataError(ValueError):
    """A record could not be read or validated. ``str()`` reads ``file:line: field: reason``."""

    def __init__(self, path: str, line: int | None, field: str | None, reason: str):
        self.path, self.line, self.field, self.reason = path, line, field, reason
        where = f"{path}:{line}" if line is not None else path
        what = f"`{field}`: " if field else ""
        super().__init__(f"{where}: {what}{reason}")

    def __reduce__(self):  # pickled to other ranks (posttrain.data.shards): rebuild from the parts, not args
        return DataError, (self.path, self.line, self.field, self.reason)
