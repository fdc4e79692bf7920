"""The decoder blocks of an HF causal LM, and a memory-lean recompute of their gated MLPs.

``parallelize()`` (``posttrain.train.parallelize``) applies ``recompute_gated_mlp`` when
``train.recompute_mlp`` is on, before activation checkpointing and FSDP.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def decoder_layers(lm: torch.nn.Module) -> torch.nn.ModuleList:
    """The ``ModuleList`` of decoder blocks (``.model.layers`` for Llama, Mistral, Qwen, …)."""
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(lm).__name__}: cannot find the decoder blocks (expected .model.layers)")
    return layers


def _down_of_gated(gate: torch.Tensor, up: torch.Tensor, act, down: torch.nn.Module) -> torch.Tensor:
    return down(act(gate) * up)


def recompute_gated_mlp(lm: torch.nn.Module) -> int:
    """Make each gated MLP (``down(act(gate(x)) * up(x))``: Llama, Mistral, Qwen) keep less for backward.

    The plain forward keeps five ``[tokens, ·]`` tensors per block for backward (``x``, ``gate``, ``up``,
    ``act(gate)``, the product); here ``act(gate) * up`` and the down projection's forward are recomputed
    in backward from ``gate`` and ``up`` (``torch.utils.checkpoint``), so two of the four wide tensors are
    never stored. The forward computes exactly the same numbers; backward pays one extra elementwise
    pass and the down projection's forward (about 3% of a step). Returns the number of MLPs changed;
    blocks whose MLP is not of that shape are left as they are.
    """
    changed = 0
    for layer in decoder_layers(lm):
        mlp = getattr(layer, "mlp", None)
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            continue

        def forward(x: torch.Tensor, mlp=mlp) -> torch.Tensor:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            if not torch.is_grad_enabled():
                return _down_of_gated(gate, up, mlp.act_fn, mlp.down_proj)
            return checkpoint(_down_of_gated, gate, up, mlp.act_fn, mlp.down_proj, use_reentrant=False)

        mlp.forward = forward
        changed += 1
    return changed
