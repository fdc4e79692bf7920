"""Progress for long work: a live bar on a terminal, a short line every few percent in a log.

``progress(...)`` is the one progress helper of the package (tokenising, reading, generating,
training, verifying). On an interactive stderr it is a tqdm bar with ETA. When stderr is a file or a
pipe (a job log, CI, ``kubectl logs``) thousands of carriage-return updates would bury the log, so it
prints one line each time another ``every_percent`` of the work is done or ``every_s`` seconds have
passed, whichever comes first, and a final line when the work ends:

    [posttrain] train: 40% 120/300 step, 3.1 step/s, ETA 58s, loss=2.113 grad_norm=0.81

Work that ends within ``quiet_s`` (``QUIET_S``, 5 s) prints nothing in a log: a flywheel round verifies,
reads and tokenises dozens of small sets in milliseconds, and ten lines each would bury the lines that
matter. Longer work is silent for its first ``quiet_s`` seconds, then reported as above, and always gets
its final line (``done in …``). A training loop passes ``quiet_s=0``: its lines carry the loss, gradient
norm and skipped updates, the run's record in the log however short the run.

``POSTTRAIN_PROGRESS=bar|lines|off`` overrides the choice (``off`` prints nothing).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

EVERY_PERCENT = 10.0
EVERY_S = 30.0
QUIET_S = 5.0  # in a log, work that ends sooner prints nothing


def mode() -> str:
    """``bar``, ``lines`` or ``off``: from ``POSTTRAIN_PROGRESS``, else ``bar`` on a terminal, ``lines`` otherwise."""
    chosen = os.environ.get("POSTTRAIN_PROGRESS", "").strip().lower()
    if chosen in ("bar", "lines", "off"):
        return chosen
    return "bar" if sys.stderr.isatty() else "lines"


def quiet_hf_progress() -> None:
    """Outside a terminal, turn off transformers' own bars ("Writing model shards", "Loading weights"): they
    would print carriage returns into a log."""
    if mode() != "bar":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _rate(rate: float) -> str:
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.2f}" if rate >= 1 else f"{rate:.3g}"


class LineProgress:
    """The subset of tqdm's interface the package uses, printed as occasional whole lines."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "", unit: str = "it",
                 initial: int = 0, every_percent: float = EVERY_PERCENT, every_s: float = EVERY_S,
                 quiet_s: float = QUIET_S, file: TextIO | None = None):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.every_percent, self.every_s, self.quiet_s = every_percent, every_s, quiet_s
        self.file = file
        self.postfix = ""
        self._start_n = initial
        self._started = self._last_time = time.monotonic()
        self._last_n = initial
        self._closed = False
        self._lines = 0

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.total or 0

    def set_postfix(self, values: dict[str, Any] | None = None, refresh: bool = False, **kwargs: Any) -> None:  # noqa: ARG002
        values = {**(values or {}), **kwargs}
        self.postfix = " ".join(f"{key}={value}" for key, value in values.items())

    def set_description(self, desc: str, refresh: bool = False) -> None:  # noqa: ARG002
        self.desc = desc

    def refresh(self) -> None:
        """After ``n`` was moved by hand (a rollback): the next line reports from there."""
        self._last_n = self.n

    def update(self, count: int = 1) -> None:
        self.n += count
        now = time.monotonic()
        if now - self._started < self.quiet_s:
            return  # quick work says nothing; the share and time rules count from the start once it is over
        due_time = now - self._last_time >= self.every_s
        due_share = bool(self.total) and (self.n - self._last_n) * 100.0 / self.total >= self.every_percent
        if due_time or due_share:
            # The update that completes the work is its final line: close() then has nothing to add.
            self._print(now, final=bool(self.total) and self.n >= self.total)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        now = time.monotonic()
        if not self._lines and now - self._started < self.quiet_s:
            return
        if self.n != self._last_n or not self._lines:
            self._print(now, final=True)

    def _print(self, now: float, final: bool = False) -> None:
        self._last_time, self._last_n = now, self.n
        self._lines += 1
        elapsed = now - self._started
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        if self.total:
            text = f"{100.0 * self.n / self.total:3.0f}% {self.n}/{self.total} {self.unit}"
        else:
            text = f"{self.n} {self.unit}"
        text += f", {_rate(rate)} {self.unit}/s"
        if final:
            text += f", done in {_duration(elapsed)}"
        elif self.total and rate > 0:
            text += f", ETA {_duration((self.total - self.n) / rate)}"
        if self.postfix:
            text += f", {self.postfix}"
        print(f"[posttrain] {self.desc}: {text}", file=self.file or sys.stderr, flush=True)


class _Silent(LineProgress):
    def _print(self, now: float, final: bool = False) -> None:  # noqa: ARG002
        return


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             initial: int = 0, disable: bool = False, leave: bool = False, quiet_s: float = QUIET_S) -> Any:
    """A progress reporter over ``iterable`` (or for ``total`` manual ``update()`` calls); see the module docstring.

    ``disable=True`` (e.g. on ranks other than 0) reports nothing but still iterates and counts. ``quiet_s``:
    in a log, how long work may take before it prints anything (the bar on a terminal shows at once).
    """
    chosen = "off" if disable else mode()
    if chosen == "bar":
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave, file=sys.stderr,
                    dynamic_ncols=True)
    cls = _Silent if chosen == "off" else LineProgress
    return cls(iterable, total=total, desc=desc, unit=unit, initial=initial, quiet_s=quiet_s)
