"""The data stream: which examples each optimizer step sees, decided up front from the seed.

The whole run's order is a pure function of (seed, curriculum, dataset), so the exact data position
after a restart is just the step number: no sampler state to save, and every rank knows every
rank's share of a step (which lets the loss be normalised by the *global* token count with no
communication).

Curricula (``data.curriculum``):
- ``none``: each epoch is a fresh permutation.
- ``tiered``: each epoch is ordered easy to hard — tier 1, then 2, then 3 (shuffled within a tier). On data
  with no ``tier`` at all every record sits in one tier, so the order is the seeded shuffle of ``none``
  (``check_curriculum`` says so in a warning); ``tiered_strict`` orders the same way and refuses such data.
- ``competence``: competence-based pacing (Platanios et al., 2019). At step t the sampler draws
  uniformly from the easiest fraction ``c(t) = min(1, sqrt(c0² + (1 − c0²) · t / T))`` of the data,
  sorted by (tier, difficulty); c rises from ``c0`` to 1 at step ``T``.

Units: a unit is what ``train.global_batch_size`` counts — one example, one packed row of several
examples, or one preference pair. Step ``s`` consumes units ``[s·G, (s+1)·G)``; how a step's units
split over ranks and micro-batches is ``posttrain.train.source.BatchGeometry``'s business. ``G``
does not depend on the number of ranks, so neither does the stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Difficulty:
    tier: int | None
    difficulty: float | None


def difficulty_order(items: Sequence[Difficulty]) -> np.ndarray:
    """Indices sorted easy to hard: by tier (missing = 2, the middle), then difficulty, then index."""
    keys = [
        (item.tier if item.tier is not None else 2, item.difficulty if item.difficulty is not None else 0.0, i)
        for i, item in enumerate(items)
    ]
    return np.array([k[2] for k in sorted(keys)], dtype=np.int64)


def competence(step: int, total_steps: int, start: float) -> float:
    """Square-root competence c(t) of Platanios et al. (2019), reaching 1 at ``total_steps``."""
    if total_steps <= 0:
        return 1.0
    return min(1.0, math.sqrt(start**2 + (1.0 - start**2) * step / total_steps))


def epoch_order(items: Sequence[Difficulty], curriculum: str, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    rng = np.random.default_rng([seed, epoch])
    n = len(items)
    if curriculum in ("tiered", "tiered_strict"):
        tiers = np.array([item.tier if item.tier is not None else 2 for item in items])
        parts = []
        for tier in sorted(set(tiers.tolist())):
            members = np.flatnonzero(tiers == tier)
            parts.append(rng.permutation(members) if shuffle else members)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return rng.permutation(n) if shuffle else np.arange(n)


def build_stream(
    items: Sequence[Difficulty],
    curriculum: str,
    seed: int,
    epochs: float | None,
    examples_per_step: int,
    max_steps: int | None,
    competence_start: float = 0.25,
    competence_steps: int | None = None,
    shuffle: bool = True,
) -> np.ndarray:
    """The run's example indices in consumption order.

    For ``none``/``tiered`` the stream is ``ceil(epochs)`` epoch orders cut to ``epochs × N``
    examples (or extended to cover ``max_steps``). For ``competence`` it is exactly
    ``total_steps × examples_per_step`` draws.
    """
    n = len(items)
    if n == 0:
        raise ValueError("the training set is empty")
    if curriculum == "competence":
        total_steps = max_steps or max(1, math.floor((epochs or 1.0) * n / examples_per_step))
        pace_steps = competence_steps or max(1, total_steps // 2)
        ordered = difficulty_order(items)
        draws = []
        for step in range(total_steps):
            pool = max(1, math.ceil(competence(step, pace_steps, competence_start) * n))
            rng = np.random.default_rng([seed, step, 7])
            draws.append(ordered[rng.choice(pool, size=examples_per_step, replace=pool < examples_per_step)])
        return np.concatenate(draws)
    if max_steps is not None:
        wanted = max_steps * examples_per_step
    else:
        wanted = math.floor((epochs or 1.0) * n)
    orders, total, epoch = [], 0, 0
    while total < wanted:
        order = epoch_order(items, curriculum, seed, epoch, shuffle)
        orders.append(order)
        total += len(order)
        epoch += 1
    return np.concatenate(orders)[:wanted]


def check_curriculum(curriculum: str, items: Sequence[Difficulty], source: str) -> str | None:
    """Refuse a curriculum the data cannot drive; return a warning text when only some items are tagged, or
    when ``tiered`` falls back to a seeded shuffle because none is.

    ``tiered`` orders by ``tier``, ``competence`` by (tier, difficulty). Untagged items sit in the middle (tier 2,
    difficulty 0). On data with no ``tier`` at all, ``tiered`` is the seeded shuffle of ``none`` (one tier,
    shuffled: the packaged SFT recipes are tiered, and a newcomer's chat file has no tiers), said in the returned
    warning; ``tiered_strict`` and ``competence`` refuse such data (their order would be arbitrary).
    """
    if curriculum == "none" or not items:
        return None
    tiered = sum(item.tier is not None for item in items)
    scored = sum(item.difficulty is not None for item in items)
    by_tier = curriculum in ("tiered", "tiered_strict")
    usable = tiered if by_tier else max(tiered, scored)
    needs = "`tier` (1-3)" if by_tier else "`tier` (1-3) or `difficulty`"
    if usable == 0 and curriculum == "tiered":
        return (f"{source}: data.curriculum=tiered but none of the {len(items)} records has {needs}: training in a "
                "seeded shuffle (train.seed), as data.curriculum=none would; tag the records (posttrain curate assigns "
                "tiers), set data.curriculum=none to silence this, or data.curriculum=tiered_strict to refuse "
                "untiered data")
    if usable == 0:
        raise ValueError(
            f"{source}: data.curriculum={curriculum} but none of the {len(items)} records has {needs}, so it "
            "would train in an arbitrary order; tag the records (posttrain curate assigns tiers) or set "
            "data.curriculum=none"
        )
    if usable < len(items):
        return (f"{source}: {len(items) - usable} of {len(items)} records have no {needs}; data.curriculum="
                f"{curriculum} places them with tier 2")
    return None
