"""Health guard: skip updates on non-finite or spiking loss / gradient norm, roll back after a streak.

A step is *bad* when its loss or gradient norm is not finite, or is a **spike**: more than
``spike_ratio`` times the largest value of the last ``window`` good steps. That is the test of
Megatron-LM's rerun state machine (``RerunStateMachine.is_unexpectedly_large``: a result above a
multiple — 10 by default — of the largest value seen), chosen over a z-score because it works from the
second step (one good value is a reference) and does not read ordinary dynamics as spikes: a z-score
against quiet first steps flags the several-fold rise of DPO's gradient norm when pairs start to
separate, and a sharp drop or the slow rises of training never approach ten times the recent
maximum. A corrupted batch or a numerical blow-up — what the guard is for — does (the drills multiply
the loss by 1000).

A bad step's update is skipped. After ``max_consecutive`` bad steps in a row the loop rolls back to the
last good checkpoint and skips the batches that caused the trouble (the recovery of PaLM, Chowdhery
et al. 2022, §5.1). Every event goes to ``alerts.jsonl`` (strict JSON: a non-finite number is written
as ``null``) and, when configured, to a webhook, and is printed as one line on stderr.
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain import dist
from posttrain.data.io import append_jsonl


def finite_or_none(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf) replaced by ``None``, recursively: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(item) for item in value]
    return value


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    rollback: bool = False


@dataclass
class HealthGuard:
    spike_ratio: float = 10.0
    window: int = 64
    max_consecutive: int = 3
    enabled: bool = True
    # An RL loss is a sum of advantage-weighted ratios around zero: its size says nothing about health,
    # and a ratio test against a near-zero history would flag ordinary steps. RL watches the gradient
    # norm (and non-finite losses) only.
    watch_loss: bool = True
    losses: deque = field(default_factory=deque)
    grad_norms: deque = field(default_factory=deque)
    consecutive_bad: int = 0

    def check(self, loss: float, grad_norm: float) -> Verdict:
        if not self.enabled:
            return Verdict(ok=True)
        reason = ""
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            reason = f"non-finite (loss={loss}, grad_norm={grad_norm})"
        elif self.losses:
            watched = [("loss", loss, self.losses)] if self.watch_loss else []
            for name, value, history in [*watched, ("grad norm", grad_norm, self.grad_norms)]:
                largest = max(abs(h) for h in history)
                if largest > 0 and abs(value) > self.spike_ratio * largest:
                    reason = (f"spike ({name} {value:.4g} is {abs(value) / largest:.0f}x the largest of the last "
                              f"{len(history)} good steps, {largest:.4g}; threshold {self.spike_ratio:g}x)")
                    break
        if reason:
            self.consecutive_bad += 1
            return Verdict(ok=False, reason=reason, rollback=self.consecutive_bad >= self.max_consecutive)
        self.consecutive_bad = 0
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        while len(self.losses) > self.window:
            self.losses.popleft()
            self.grad_norms.popleft()
        return Verdict(ok=True)

    def state(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "consecutive_bad": self.consecutive_bad}

    def load(self, state: dict[str, Any]) -> None:
        self.losses = deque(state["losses"])
        self.grad_norms = deque(state["grad_norms"])
        self.consecutive_bad = state["consecutive_bad"]


class Alerts:
    """Events to ``alerts.jsonl`` (rank 0), a webhook when one is set, and one line each on stderr.

    Writing an alert never stops training: an alert file that cannot be written (a full disk) or a
    webhook that is down is reported once on stderr and the run goes on. ``listeners`` are called with each
    event on rank 0 (the Prometheus exporter counts them by kind).
    """

    QUIET = frozenset({"config_warning"})  # already printed as a Python warning

    def __init__(self, path: Path, webhook: str | None = None, timeout_s: float = 5.0, echo: bool = True):
        self.path, self.webhook, self.timeout_s, self.echo = path, webhook, timeout_s, echo
        self._file_failed = False
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def emit(self, kind: str, *, message: str | None = None, echo: bool = True, **fields: Any) -> dict[str, Any]:
        """Record one event; ``message`` is the line printed (default: the kind and its fields)."""
        event = finite_or_none({"time": time.time(), "kind": kind, **fields, **({"message": message} if message else {})})
        if not dist.is_main():
            return event
        if echo and self.echo and kind not in self.QUIET:
            line = message or f"{kind.replace('_', ' ')}: " + ", ".join(f"{k}={v}" for k, v in fields.items())
            print(f"[posttrain] {line}", file=sys.stderr, flush=True)
        self._append(event)
        for listener in self.listeners:
            listener(event)
        if self.webhook:
            request = urllib.request.Request(
                self.webhook, data=json.dumps(event, allow_nan=False).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                urllib.request.urlopen(request, timeout=self.timeout_s).close()
            except OSError as exc:  # an alert channel being down must not kill training
                self._append({"time": time.time(), "kind": "webhook_failed", "error": str(exc)})
        return event

    def emit_own(self, kind: str, *, message: str | None = None, echo: bool = True, **fields: Any) -> dict[str, Any]:
        """An event only this rank knows of (its watchdog fired, its upload failed): rank 0 records it as
        ``emit`` does; another rank prints it and appends it to ``alerts-rank<r>.jsonl`` beside
        ``alerts.jsonl`` — alerts of every rank go through rank 0 otherwise, which may be the healthy rank
        that waits, or on a node of its own."""
        if dist.is_main():
            return self.emit(kind, message=message, echo=echo, **fields)
        event = finite_or_none({"time": time.time(), "kind": kind, **fields, **({"message": message} if message else {})})
        if echo and self.echo:
            print(f"[posttrain] rank {dist.rank()}: {message or kind}", file=sys.stderr, flush=True)
        path = self.path.with_name(f"{self.path.stem}-rank{dist.rank()}{self.path.suffix}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            append_jsonl(str(path), [event])
        except OSError as exc:
            print(f"[posttrain] cannot write {path} ({exc.strerror or exc}); the alert is on stderr only",
                  file=sys.stderr, flush=True)
        return event

    def _append(self, event: dict[str, Any]) -> None:
        try:
            append_jsonl(str(self.path), [event])
        except OSError as exc:
            if not self._file_failed:
                print(f"[posttrain] cannot write {self.path} ({exc.strerror or exc}); alerts go to stderr only",
                      file=sys.stderr, flush=True)
            self._file_failed = True
