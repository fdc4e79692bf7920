"""The one function that applies MLP recompute, expert parallelism, activation checkpointing, torch.compile
and FSDP2, in that order.

Order matters (as in torchtitan's ``parallelize``): the MLP recompute patches each block's MLP
forward in place; expert parallelism (``parallel.expert``, ``posttrain.train.expert_parallel``) keeps
each rank's share of every MoE layer's experts and gives the experts their all-to-all forward;
checkpoint wrappers go on the decoder blocks next; ``train.compile`` compiles each (wrapped) block, so
the recomputation is compiled with it; then ``fully_shard`` wraps each MoE layer's experts (over the
replicas of their EP shard), each (wrapped) block and finally the root, so each block's parameters are
gathered just in time and freed after use — ZeRO-3 for parameters, gradients and optimizer state. With
``parallel.expert > 1`` every parameter lives on one 2-D mesh ``(efsdp, ep)``; the dense parts are sharded
over ``ep`` and replicated over ``efsdp`` (plain FSDP when the world is one EP group; see
``posttrain.train.expert_parallel`` for why).
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from posttrain import dist
from posttrain.models.blocks import decoder_layers, recompute_gated_mlp
from posttrain.train.expert_parallel import check_expert_degree, expert_mesh, shard_experts
from posttrain.train.offload import accelerator_available


def uses_fsdp(fsdp: str) -> bool:
    """Whether ``train.fsdp`` shards in this process: ``on``, or ``auto`` with more than one rank."""
    return fsdp == "on" or (fsdp == "auto" and dist.world_size() > 1)


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


def compile_blocks(layers: torch.nn.ModuleList) -> int:
    """``torch.compile`` each decoder block in place (``train.compile``); returns how many.

    In place (``Module.compile``), not ``torch.compile(block)``: the block stays the same module, so
    parameter and state-dict names do not gain ``_orig_mod.`` and checkpoints, export and LoRA see the
    same model as without compile. One compiled graph per block type is reused by every block; a new
    sequence length recompiles once with a dynamic length, then reuses it.
    """
    for layer in layers:
        layer.compile()
    return len(layers)


def parallelize(
    root: torch.nn.Module,
    lm: torch.nn.Module,
    *,
    fsdp: str,
    precision: str,
    cpu_offload: bool,
    activation_checkpointing: str,
    ac_every: int,
    recompute_mlp: bool = False,
    compile: bool = False,
    expert: int = 1,
) -> dict[str, object]:
    """Apply MLP recompute, EP (``expert`` ranks per MoE layer's experts), AC, torch.compile (``compile``), then
    FSDP2 to ``root`` (whose submodule ``lm`` holds the blocks), in place.

    Returns a summary of what was applied. Without FSDP (one process), bf16 runs under autocast
    (``posttrain.train.precision``).
    """
    world = dist.world_size()
    sharded = uses_fsdp(fsdp)
    if world > 1 and not sharded:
        raise ValueError("train.fsdp=off with several ranks: posttrain shards with FSDP2 across ranks; use auto/on")
    experts = check_expert_degree(lm, expert, world)
    if expert > 1 and not sharded:
        raise ValueError(f"parallel.expert={expert} needs FSDP across {expert} or more ranks: launch with torchrun "
                         f"--nproc_per_node {expert} (train.fsdp auto/on)")
    mesh = expert_mesh(world, expert, dist.device().type) if expert > 1 else None
    recomputed = recompute_gated_mlp(lm) if recompute_mlp else 0
    ep_layers = shard_experts(experts, mesh) if mesh is not None else 0
    layers = decoder_layers(lm)
    checkpointed = apply_activation_checkpointing(layers, activation_checkpointing, ac_every)
    compiled = compile_blocks(layers) if compile else 0
    if sharded:
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if precision == "bf16" else None,
            reduce_dtype=torch.float32,
        )
        kwargs: dict[str, object] = {"mp_policy": mp}
        if cpu_offload:
            # pin_memory() needs an accelerator: on a CPU-only machine it raises from inside FSDP.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=accelerator_available())
        if mesh is not None:
            for module in experts:  # over the replicas of this EP shard; gradients divided like the dense ones
                sharded_experts = fully_shard(module, mesh=mesh["efsdp"], **kwargs)
                sharded_experts.set_gradient_divide_factor(float(world))
                if mesh["efsdp"].size() > 1 and not torch.cuda.is_available():
                    # gloo has no PREMUL_SUM: reduce with SUM and divide around it (no reduction at all at size 1)
                    sharded_experts.set_force_sum_reduction_for_comms(True)
            kwargs["mesh"] = mesh  # HSDP: replicated over efsdp, sharded over ep (one mesh for every DTensor)
        for block in layers:
            fully_shard(block, **kwargs)
        fully_shard(root, **kwargs)
    elif torch.cuda.is_available():
        root.to(dist.device())
    return {"fsdp": sharded, "world_size": world, "checkpointed_blocks": checkpointed,
            "recomputed_mlps": recomputed, "compiled_blocks": compiled, "blocks": len(layers),
            "expert_parallel": expert, "ep_layers": ep_layers}
