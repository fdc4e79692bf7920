"""Health guard: skip updates on non-finite or spiking loss / gradient norm, roll back after a streak.

A step is *bad* when its loss or gradient norm is not finite, or when either is a spike: a z-score
above ``spike_zscore`` against the last ``window`` good steps (after ``min_history`` of them). A bad
step's update is skipped. After ``max_consecutive`` bad steps in a row the loop rolls back to the
last good checkpoint and skips the batches that caused the trouble (the recovery of PaLM, Chowdhery
et al. 2022, §5.1). Every event goes to ``alerts.jsonl`` and, when configured, to a webhook.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain import dist
from posttrain.data.io import append_jsonl


def zscore(value: float, history: list[float]) -> float:
    """(value − mean) / std over ``history``; 0 when the history is flat."""
    n = len(history)
    mean = sum(history) / n
    var = sum((h - mean) ** 2 for h in history) / max(1, n - 1)
    std = math.sqrt(var)
    return (value - mean) / std if std > 1e-12 else 0.0


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    rollback: bool = False


@dataclass
class HealthGuard:
    spike_zscore: float = 6.0
    window: int = 128
    min_history: int = 16
    max_consecutive: int = 3
    enabled: bool = True
    losses: deque = field(default_factory=deque)
    grad_norms: deque = field(default_factory=deque)
    consecutive_bad: int = 0

    def check(self, loss: float, grad_norm: float) -> Verdict:
        if not self.enabled:
            return Verdict(ok=True)
        reason = ""
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            reason = f"non-finite (loss={loss}, grad_norm={grad_norm})"
        elif len(self.losses) >= self.min_history:
            z_loss = zscore(loss, list(self.losses))
            z_grad = zscore(grad_norm, list(self.grad_norms))
            if z_loss > self.spike_zscore or z_grad > self.spike_zscore:
                reason = f"spike (loss z={z_loss:.1f}, grad-norm z={z_grad:.1f}, threshold {self.spike_zscore})"
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
    """Append events to ``alerts.jsonl`` (rank 0) and POST them to a webhook when one is set."""

    def __init__(self, path: Path, webhook: str | None = None, timeout_s: float = 5.0):
        self.path, self.webhook, self.timeout_s = path, webhook, timeout_s

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"time": time.time(), "kind": kind, **fields}
        if not dist.is_main():
            return event
        append_jsonl(str(self.path), [event])
        if self.webhook:
            request = urllib.request.Request(
                self.webhook, data=json.dumps(event).encode(), headers={"Content-Type": "application/json"}
            )
            try:
                urllib.request.urlopen(request, timeout=self.timeout_s).close()
            except OSError as exc:  # an alert channel being down must not kill training
                append_jsonl(str(self.path), [{"time": time.time(), "kind": "webhook_failed", "error": str(exc)}])
        return event
