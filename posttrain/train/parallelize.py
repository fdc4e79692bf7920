"""The one function that applies activation checkpointing and FSDP2, in that fixed order.

Order matters (as in torchtitan's ``parallelize``): checkpoint wrappers go on the decoder blocks
first, then ``fully_shard`` wraps each (wrapped) block and finally the root, so each block's
parameters are gathered just in time and freed after use — ZeRO-3 for parameters, gradients and
optimizer state.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from posttrain import dist


def decoder_layers(lm: torch.nn.Module) -> torch.nn.ModuleList:
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(lm).__name__}: cannot find the decoder blocks (expected .model.layers)")
    return layers


def apply_activation_checkpointing(layers: torch.nn.ModuleList, mode: str, every: int) -> int:
    """Wrap blocks for recomputation: ``full`` = every block, ``selective`` = every ``every``-th block."""
    if mode == "none":
        return 0
    wrapped = 0
    for index in range(len(layers)):
        if mode == "full" or (mode == "selective" and index % every == 0):
            layers[index] = checkpoint_wrapper(layers[index])
            wrapped += 1
    return wrapped


def parallelize(
    root: torch.nn.Module,
    lm: torch.nn.Module,
    *,
    fsdp: str,
    precision: str,
    cpu_offload: bool,
    activation_checkpointing: str,
    ac_every: int,
) -> dict[str, object]:
    """Apply AC then FSDP2 to ``root`` (whose submodule ``lm`` holds the decoder blocks), in place.

    Returns a summary of what was applied. Without FSDP (one process), bf16 runs under autocast.
    """
    world = dist.world_size()
    use_fsdp = fsdp == "on" or (fsdp == "auto" and world > 1)
    if world > 1 and not use_fsdp:
        raise ValueError("train.fsdp=off with several ranks: posttrain shards with FSDP2 across ranks; use auto/on")
    layers = decoder_layers(lm)
    checkpointed = apply_activation_checkpointing(layers, activation_checkpointing, ac_every)
    if use_fsdp:
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if precision == "bf16" else None,
            reduce_dtype=torch.float32,
        )
        offload = CPUOffloadPolicy() if cpu_offload else None
        kwargs = {"mp_policy": mp}
        if offload is not None:
            kwargs["offload_policy"] = offload
        for block in layers:
            fully_shard(block, **kwargs)
        fully_shard(root, **kwargs)
    elif torch.cuda.is_available():
        root.to(dist.device())
    return {"fsdp": use_fsdp, "world_size": world, "checkpointed_blocks": checkpointed, "blocks": len(layers)}
