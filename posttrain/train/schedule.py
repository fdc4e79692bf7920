"""Learning-rate schedules as pure functions of the step (so resume needs no scheduler state).

``lr_at(step)`` = peak × warmup(step) × decay(step): linear warmup over ``warmup_steps``, then
constant, linear or cosine decay to ``min_lr_ratio × peak`` at ``total_steps``.
"""

from __future__ import annotations

import math


def lr_multiplier(step: int, total_steps: int, schedule: str, warmup_steps: int, min_lr_ratio: float) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}; use constant, linear or cosine")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay
