"""Mixture-of-experts models: which architectures posttrain knows, where their routers are, tiny ones for tests.

transformers (5.x) ships MoE models with fused experts (``Qwen3MoeExperts``: every expert's weights stacked in
one ``[E, …]`` parameter) and a router module per MoE layer (``Qwen3MoeTopKRouter``, ``DeepseekV3TopkRouter``)
whose forward returns ``(router_logits, gate_weights, selected_experts)``. posttrain reads routing from those
router outputs with forward hooks (``posttrain.train.router``), so no recipe and no model code changes.

``MOE_ARCHS`` names the architectures whose routing posttrain has checked: the balance loss their papers define
and whether their router chooses with a correction bias (DeepSeek-V3's auxiliary-loss-free balancing). Another
MoE architecture trains like any model, but ``model.moe`` refuses it until it is added here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoeArch:
    balance_loss: str  # the name in posttrain.algorithms.router.BALANCE_LOSSES
    selection_bias: bool  # the router adds e_score_correction_bias to its scores when choosing


MOE_ARCHS: dict[str, MoeArch] = {
    "qwen3_moe": MoeArch(balance_loss="switch", selection_bias=False),
    "deepseek_v3": MoeArch(balance_loss="deepseek_v3", selection_bias=True),
}

BIAS = "e_score_correction_bias"
_LAYER = re.compile(r"layers\.(\d+)\.")


class MoeConfigError(ValueError):
    """``model.moe`` asks for something the model cannot do (a dense model, a router without a bias…)."""


def is_router(module: torch.nn.Module) -> bool:
    """A top-k router of a transformers MoE layer: ``…TopKRouter`` / ``…TopkRouter`` with ``top_k`` and a
    ``[E, hidden]`` weight."""
    return (type(module).__name__.lower().endswith("topkrouter") and hasattr(module, "top_k")
            and isinstance(getattr(module, "weight", None), torch.Tensor))


def routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, router)`` of every MoE layer, in layer order (a dense model: ``[]``)."""
    found = []
    for name, module in model.named_modules():
        if is_router(module):
            match = _LAYER.search(name + ".")
            found.append((int(match.group(1)) if match else len(found), module))
    return sorted(found, key=lambda item: item[0])


def decoders(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder stacks (``embed_tokens`` + ``layers``) whose forward receives the attention mask."""
    return [m for m in model.modules() if hasattr(m, "embed_tokens") and isinstance(getattr(m, "layers", None),
                                                                                  torch.nn.ModuleList)]


def num_experts(config) -> int | None:
    """Routed experts per MoE layer from an HF config (``None``: a dense model)."""
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def active_share(model: torch.nn.Module) -> dict[int, float]:
    """``id(parameter) → K / E`` for every stacked-experts parameter: the share of it one token uses (top-K of
    E experts), so FLOPs per token count active, not total, parameters."""
    shares: dict[int, float] = {}
    for _, router in routers(model):
        experts = getattr(router, "num_experts", None) or router.weight.shape[0]
        share = router.top_k / experts
        for module in model.modules():
            if type(module).__name__.endswith("Experts") and getattr(module, "num_experts", None) == experts:
                for param in module.parameters(recurse=False):
                    shares[id(param)] = share
    return shares


def check_moe_settings(model_type: str, experts: int | None, moe, lora: bool, where: str) -> MoeArch | None:
    """``model.moe`` against the model it will train (``where``: the path, for the message); returns the
    architecture's routing (``None`` for a dense model without ``model.moe``). Raises ``MoeConfigError``."""
    if experts is None:
        if moe is not None:
            raise MoeConfigError(f"model.moe is set but {where} is a dense {model_type} model (no experts, no "
                                 "router): remove model.moe, or point model.path at a mixture-of-experts model")
        return None
    arch = MOE_ARCHS.get(model_type)
    if moe is None:
        return arch
    if arch is None:
        raise MoeConfigError(f"model.moe: posttrain has not checked the routing of {model_type} models ({where}); "
                             f"it knows {', '.join(sorted(MOE_ARCHS))}. Remove model.moe to train without router "
                             "losses, or add the architecture to posttrain.models.moe.MOE_ARCHS")
    if moe.bias_update_rate > 0 and not arch.selection_bias:
        raise MoeConfigError(f"model.moe.bias_update_rate={moe.bias_update_rate:g}: {model_type} routers choose "
                             "experts without a correction bias (DeepSeek-V3's auxiliary-loss-free balancing needs "
                             "one); set it to 0 and balance with model.moe.aux_loss_weight")
    if moe.bias_update_rate > 0 and lora:
        raise MoeConfigError("model.moe.bias_update_rate with model.lora: the router biases are not adapter weights, "
                             "so the adapter and the merged export (which reloads the base) would lose them; train "
                             "without LoRA, or set bias_update_rate to 0")
    return arch


# ----------------------------------------------------------------------------- tiny MoE configs


def tiny_moe_config(arch: str, *, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                    num_kv_heads: int, experts: int, experts_per_token: int, shared_experts: int,
                    max_position_embeddings: int, tie_word_embeddings: bool, bos_token_id: int, eos_token_id: int,
                    pad_token_id: int):
    """A small HF config of ``arch`` (``qwen3_moe`` or ``deepseek_v3``) with ``experts`` routed experts, top-K
    ``experts_per_token``, every layer sparse (DeepSeek-V3: the first layer dense, as the first 3 of its 61 are).
    Expert width is ``hidden_size / 2`` (fine-grained experts, as both families use)."""
    if not 1 <= experts_per_token <= experts:
        raise MoeConfigError(f"--experts-per-token={experts_per_token} must be between 1 and --experts={experts}")
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 4,
                  moe_intermediate_size=max(hidden_size // 2, 8), num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                  bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                  rms_norm_eps=1e-5, initializer_range=0.02, num_experts_per_tok=experts_per_token,
                  norm_topk_prob=True)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        if shared_experts:
            raise MoeConfigError("qwen3_moe has no shared experts (Qwen3-MoE dropped Qwen2-MoE's shared expert); use "
                             "--arch deepseek_v3 for a model with shared experts")
        return Qwen3MoeConfig(**common, num_experts=experts, head_dim=hidden_size // num_heads,
                              decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        if num_layers < 2:
            raise MoeConfigError("deepseek_v3: --layers must be at least 2 (the first layer is dense, as in DeepSeek-V3)")
        head = hidden_size // num_heads
        # Multi-head latent attention at a small scale: queries and keys/values through low-rank latents,
        # each head's query/key split into a rotary part and a position-free part.
        return DeepseekV3Config(**{**common, "num_key_value_heads": num_heads}, n_routed_experts=experts,
                                n_shared_experts=shared_experts, n_group=1, topk_group=1, first_k_dense_replace=1,
                                q_lora_rank=hidden_size // 2, kv_lora_rank=hidden_size // 4,
                                qk_nope_head_dim=head, qk_rope_head_dim=max(head // 2, 2), v_head_dim=head,
                                rope_scaling=None)
    raise MoeConfigError(f"unknown MoE architecture {arch!r}; choose one of {', '.join(sorted(MOE_ARCHS))}")
