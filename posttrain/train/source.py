"""The loop's open contract: a ``StepSource`` hands the loop each optimizer step's work when it is due.

The loop never holds the run's data. Before step ``s`` it asks ``source.next_step(s, model)`` for
this rank's micro-batches, so a source may read them from a fixed stream (SFT, DPO, RM, pretrain:
``StreamSource``) or make them from the current model (an RL source samples rollouts from the weights the
loop is training). After the step, ``source.end_step`` folds what the step measured into the
source's own state (BCO's running reward shift, an RL prompt sampler's pass rates) — only for steps
whose update the health guard accepted, so a skipped batch leaves no trace there either. It may
return log fields known only after the step (an RL source's training time); they join the step's record.
``state()`` / ``load_state()`` round-trip that state through every checkpoint, and the loop restores
it on resume *and* on a health-guard rollback.

Batch geometry (``BatchGeometry``): ``train.global_batch_size`` units per optimizer step, whatever
the number of ranks; each rank takes ``global / world`` of them in micro-batches of at most
``train.batch_size``. Step ``s`` of a stream consumes units ``[s·G, (s+1)·G)``; rank ``r``'s
micro-batch ``a`` is ``s·G + (a·W + r)·B`` of length ``B``. Because ``G`` does not depend on the world
size, a run checkpointed on 2 ranks resumes on 1 (or 4) at exactly the same data position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


class BatchSizeError(ValueError):
    """The global batch does not split over the ranks and micro-batches; the message says how to fix it."""


@dataclass(frozen=True)
class BatchGeometry:
    """How one optimizer step's ``global_batch`` units split over ``world`` ranks and micro-batches."""

    global_batch: int
    micro_batch: int
    world: int

    @classmethod
    def derive(cls, global_batch: int, batch_size: int, world: int) -> BatchGeometry:
        """Per-rank share ``global_batch / world`` in micro-batches of ``min(batch_size, share)`` units."""
        if global_batch % world:
            multiples = ", ".join(str(world * k) for k in range(1, 4))
            raise BatchSizeError(
                f"train.global_batch_size={global_batch} does not split over {world} ranks; "
                f"use a multiple of {world} (e.g. {multiples})"
            )
        share = global_batch // world
        micro = min(batch_size, share)
        if share % micro:
            divisors = [d for d in range(1, share + 1) if share % d == 0]
            raise BatchSizeError(
                f"each of the {world} ranks takes {share} units per step (train.global_batch_size={global_batch}), "
                f"which is not a whole number of micro-batches of train.batch_size={batch_size}; set "
                f"train.batch_size to one of {divisors} or change train.global_batch_size"
            )
        return cls(global_batch, micro, world)

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world

    @property
    def grad_accum(self) -> int:
        return self.per_rank // self.micro_batch

    def micro_slice(self, step: int, micro: int, rank: int) -> slice:
        """The units rank ``rank`` uses for micro-batch ``micro`` of step ``step`` (a stream position)."""
        start = step * self.global_batch + (micro * self.world + rank) * self.micro_batch
        return slice(start, start + self.micro_batch)

    def step_slice(self, step: int) -> slice:
        return slice(step * self.global_batch, (step + 1) * self.global_batch)


@dataclass
class StepBatch:
    """One optimizer step's work for this rank.

    - ``micro_batches``: what ``loss(model, micro_batch)`` takes, in order. With ``updates > 1`` they are
      split into ``updates`` equal consecutive groups, one optimizer update each (PPO-style inner epochs
      or mini-batches; SFT, DPO and RM make one update per step).
    - ``normalizer``: what the summed loss of one update is divided by, over **all ranks** (loss tokens
      for SFT, pairs for DPO), so accumulation and rank count do not change the gradient. One value for
      every update, or one per update.
    - ``tokens`` / ``loss_tokens``: the step's totals over all ranks, for throughput and MFU. ``tokens`` (real,
      not padding) also divides an MoE policy's router losses (``posttrain.train.router``), so it must count
      what the policy's forwards see.
    - ``log``: extra per-step log fields (tiers drawn, rollout statistics…).
    - ``unit_ids``: ids of this rank's units, written per step when ``debug.log_unit_ids`` is on.
    - ``before_update``: called once per step by every rank, after the first update's backward and before its
      optimizer step — the last moment the step's starting weights are live. GRPO's step source finishes
      there the rollouts it sampled in the background meanwhile (``rl.max_staleness``), which still need those
      weights (the trainer's log-probs); ``log`` may still gain fields then.
    """

    micro_batches: list[Any]
    normalizer: float | list[float]
    updates: int = 1
    tokens: int = 0
    loss_tokens: int = 0
    log: dict[str, Any] = field(default_factory=dict)
    unit_ids: list[str] = field(default_factory=list)
    before_update: Callable[[], None] | None = None

    def groups(self) -> list[tuple[list[Any], float]]:
        """``(micro-batches, normaliser)`` per optimizer update."""
        count = len(self.micro_batches)
        if self.updates < 1 or count % self.updates:
            raise ValueError(f"{count} micro-batches do not split into {self.updates} equal updates")
        size = count // self.updates
        norms = self.normalizer if isinstance(self.normalizer, list) else [self.normalizer] * self.updates
        if len(norms) != self.updates:
            raise ValueError(f"{len(norms)} normalisers for {self.updates} updates")
        return [(self.micro_batches[u * size : (u + 1) * size], max(float(norms[u]), 1.0)) for u in range(self.updates)]


LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, torch.Tensor | float]]]


@runtime_checkable
class StepSource(Protocol):
    """What an algorithm gives the loop besides its loss (see the module docstring).

    ``state()`` must be JSON-serialisable and the same on every rank (it is saved once, by rank 0, and
    loaded on any number of ranks). ``end_step`` receives the step's metric sums over all ranks.
    """

    name: str

    def total_steps(self) -> int: ...

    def next_step(self, step: int, model: torch.nn.Module) -> StepBatch: ...

    def end_step(self, step: int, accepted: bool, metric_sums: dict[str, float]) -> dict[str, Any] | None:
        """Fold the step into the source's state; may return log fields known only after the step (e.g. how
        long training took next to sampling), which the loop adds to the step's record."""
        ...

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


class StreamSource:
    """A source over a deterministic, precomputed order of units (today's stream; see ``stream.py``).

    ``units`` is the whole run's consumption order; step ``s`` takes ``geometry.step_slice(s)``.
    ``collate(units)`` builds one micro-batch; ``normalizer(units)``, ``describe(units)`` and
    ``token_counts(units)`` are evaluated over the step's *global* units, which every rank can see.
    Subclasses add state (``DPOSource``'s BCO shift) by overriding ``end_step`` / ``state`` / ``load_state``.
    """

    def __init__(
        self,
        name: str,
        units: Sequence[Any],
        geometry: BatchGeometry,
        collate: Callable[[list[Any]], Any],
        normalizer: Callable[[list[Any]], float],
        rank: int = 0,
        describe: Callable[[list[Any]], dict[str, Any]] = lambda units: {},
        token_counts: Callable[[list[Any]], tuple[int, int]] = lambda units: (0, 0),
        unit_ids: Callable[[Any], list[str]] = lambda unit: [],
    ):
        self.name, self.units, self.geometry, self.rank = name, units, geometry, rank
        self.collate, self.normalizer, self.describe = collate, normalizer, describe
        self.token_counts, self.unit_ids = token_counts, unit_ids
        self.position = 0  # units consumed; a check on resume, since the stream itself is a function of the step

    def total_steps(self) -> int:
        return len(self.units) // self.geometry.global_batch

    def step_units(self, step: int) -> list[Any]:
        return list(self.units[self.geometry.step_slice(step)])

    def rank_units(self, step: int, micro: int) -> list[Any]:
        return list(self.units[self.geometry.micro_slice(step, micro, self.rank)])

    def next_step(self, step: int, model: torch.nn.Module) -> StepBatch:  # noqa: ARG002 - a stream ignores the model
        global_units = self.step_units(step)
        mine = [self.rank_units(step, micro) for micro in range(self.geometry.grad_accum)]
        tokens, loss_tokens = self.token_counts(global_units)
        return StepBatch(
            micro_batches=[self.collate(units) for units in mine],
            normalizer=float(self.normalizer(global_units)),
            tokens=tokens,
            loss_tokens=loss_tokens,
            log=self.describe(global_units),
            unit_ids=[uid for units in mine for unit in units for uid in self.unit_ids(unit)],
        )

    def end_step(self, step: int, accepted: bool, metric_sums: dict[str, float]) -> None:  # noqa: ARG002
        self.position = (step + 1) * self.geometry.global_batch

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "global_batch": self.geometry.global_batch}

    def load_state(self, state: dict[str, Any]) -> None:
        if state.get("global_batch", self.geometry.global_batch) != self.geometry.global_batch:
            raise BatchSizeError(
                f"the checkpoint was written with train.global_batch_size={state['global_batch']}, this run has "
                f"{self.geometry.global_batch}: the data position would not be exact. Resume with "
                f"train.global_batch_size={state['global_batch']}"
            )
        self.position = int(state.get("position", 0))
