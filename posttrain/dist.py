"""The one place that knows about ranks. Everything else asks these helpers.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain ``python`` run is rank 0 of 1 and never
initialises a process group.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 1800.0) -> bool:
    """Initialise the process group when launched by torchrun; return whether it is distributed."""
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return True


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum ``value`` over ranks, in place; the collective runs on the rank's device (NCCL needs CUDA tensors)."""
    if dist.is_initialized():
        on_device = value.to(device())
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
        if on_device is not value:
            value.copy_(on_device)
    return value


def broadcast_object(obj):
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` in one process."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def destroy() -> None:
    # Every rank reaches the same point before the group goes away: a rank that tears down gloo while
    # a peer still has work in flight can abort at exit ("terminate called without an active exception").
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
