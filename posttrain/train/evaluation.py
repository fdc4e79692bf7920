"""The one sharded evaluation pass: held-out sums over a list of units, split over ranks.

SFT's eval loss, DPO's held-out loss and accuracies and the reward model's pairwise accuracy are all
sums over units divided by a count, so each recipe gives ``measure(model, units) -> tensor of sums``
and ``sharded_sums`` does the rest: rank ``r`` takes chunks ``r, r + W, …`` of ``batch_size`` units,
every rank runs the same number of forwards (FSDP's gathers are collectives; a rank with no chunk
left measures a dummy chunk with weight 0), and the sums are all-reduced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from posttrain import dist


def reshard(model: torch.nn.Module) -> None:
    """After forwards without backward, put FSDP2's root parameters back to their sharded form.

    FSDP2 keeps the root's parameters unsharded after its forward (backward would reshard them). An
    evaluation pass has no backward; an optimizer built or stepped afterwards would otherwise see the
    unsharded tensors instead of the sharded parameters.
    """
    if hasattr(model, "reshard"):
        model.reshard()


@torch.no_grad()
def chunk_sums(*terms: torch.Tensor, count: int) -> torch.Tensor:
    """A ``sharded_sums`` measure's result: the chunk's sums and its unit count as one float64 vector, all on the
    terms' device (a host tensor among CUDA ones fails the stack: held-out RM and DPO evaluation did on a GPU)."""
    return torch.stack([*(term.double() for term in terms), terms[0].new_tensor(float(count), dtype=torch.float64)])


def sharded_sums(
    model: torch.nn.Module,
    units: Sequence[Any],
    batch_size: int,
    measure: Callable[[torch.nn.Module, list[Any]], torch.Tensor],
) -> torch.Tensor:
    """``Σ measure(chunk)`` over every chunk of ``units``, computed across ranks; the same on every rank.

    ``measure(model, chunk)`` returns a 1-D tensor of sums (its length must not depend on the chunk). The
    model is in eval mode during the pass and back in train mode after it, and the measure runs without
    autograd: a held-out forward that built a graph kept every activation of the chunk alive for nothing.
    """
    if not units:
        raise ValueError("sharded_sums needs at least one unit")
    world, rank = dist.world_size(), dist.rank()
    was_training = model.training
    model.eval()
    total: torch.Tensor | None = None
    try:
        for index in range(math.ceil(len(units) / (batch_size * world))):
            start = (index * world + rank) * batch_size
            chunk = list(units[start : start + batch_size])
            weight = 1.0 if chunk else 0.0
            with torch.no_grad():
                sums = measure(model, chunk or [units[0]]).to("cpu", torch.float64) * weight
            total = sums if total is None else total + sums
    finally:
        model.train(was_training)
    reshard(model)
    assert total is not None
    return dist.all_reduce_sum(total)
