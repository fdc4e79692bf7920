"""Router losses and the auxiliary-loss-free balance update of mixture-of-experts models: the math only.

Every function takes one MoE layer's routing of a micro-batch, shaped by rows (sequences):

- ``logits [R, T, E]``: the router's pre-activation scores, per row ``r``, token ``t`` and expert ``e``;
- ``selected [R, T, K]``: the ``K`` experts each token was sent to (int64);
- ``mask [R, T]``: 1 for a real token, 0 for padding (padding is routed too, but never counted).

A loss returns one value per row, ``[R]``: the loss *of that sequence* as its paper defines it. The loop
(``posttrain.train.router``) adds ``Σ_r n_r · L_r`` (``n_r``: the row's real tokens) over micro-batches and
ranks and divides by the step's token count, so each loss is a sum over tokens divided by a number every rank
and micro-batch agrees on: gradient accumulation and the rank count do not change the gradient.

Departure, shared by the balance losses: their statistics ``f`` and ``P`` are taken **per sequence**
(DeepSeek-V3's complementary sequence-wise loss; Megatron-LM's ``seq_aux_loss``), for the Switch/Qwen form too,
whose reference code (transformers' ``load_balancing_loss_func``) takes them over the whole micro-batch. A
micro-batch-level ``f·P`` is not a sum over anything, so it changes with how a step is split into
micro-batches and ranks — which posttrain's equivalence rule forbids. Per-sequence balance is the stricter
constraint (Qiu et al. 2025, "Demons in the Detail", argue the looser global-batch one trains better
experts); keep its weight small.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from posttrain.algorithms.registry import Registry

BalanceLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BALANCE_LOSSES: Registry[BalanceLoss] = Registry("load-balancing loss")


def _checked(logits: torch.Tensor, selected: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 logits, the mask as fp32, and ``assigned [R, T, E]``: 1 where the token went to the expert."""
    if logits.dim() != 3 or selected.shape[:2] != logits.shape[:2] or mask.shape != logits.shape[:2]:
        raise ValueError(f"router shapes: logits [R, T, E], selected [R, T, K], mask [R, T]; got "
                         f"{tuple(logits.shape)}, {tuple(selected.shape)}, {tuple(mask.shape)}")
    logits = logits.float()
    assigned = torch.zeros_like(logits).scatter_(2, selected.long(), 1.0)
    return logits, assigned, mask.to(logits.dtype)


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's real tokens: ``[R, T, E] → [R, E]`` (0 for a row of padding only)."""
    return (values * mask.unsqueeze(-1)).sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)


def expert_load(selected: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens sent to each expert, real tokens only: ``[E]`` (each token counts once per chosen expert, so the
    loads add up to ``K ·`` real tokens). No gradient: it counts choices."""
    assigned = torch.zeros((*selected.shape[:2], num_experts), dtype=torch.float32, device=selected.device)
    assigned.scatter_(2, selected.long(), 1.0)
    return (assigned * mask.to(torch.float32).unsqueeze(-1)).sum(dim=(0, 1))


@BALANCE_LOSSES.register("switch")
def switch_balance_loss(logits: torch.Tensor, selected: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4) in the form Qwen3-MoE and Mixtral use:

    ``L = E · Σ_i f_i · P_i`` with ``f_i = (1/T) Σ_t Σ_k 1[selected_{t,k} = i]`` (the share of tokens routed to
    expert ``i``; the ``f_i`` add up to ``K``, as in transformers' ``load_balancing_loss_func``) and
    ``P_i = (1/T) Σ_t softmax(logits_t)_i``. Perfect balance gives ``L = K``. Gradient flows through ``P`` only.
    Per sequence (module docstring): ``[R]``.
    """
    logits, assigned, mask = _checked(logits, selected, mask)
    fraction = _row_mean(assigned, mask)
    probability = _row_mean(torch.softmax(logits, dim=-1), mask)
    return logits.shape[-1] * (fraction * probability).sum(dim=-1)


@BALANCE_LOSSES.register("deepseek_v3")
def deepseek_v3_balance_loss(logits: torch.Tensor, selected: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (DeepSeek-AI 2024, eqs. 17–20), sigmoid routers:

    ``L = Σ_i f_i · P_i`` with ``f_i = E / (K·T) · Σ_t 1[i ∈ TopK_t]`` and ``P_i = (1/T) Σ_t s'_{i,t}``, where
    ``s_{i,t} = sigmoid(logits_{t,i})`` and ``s' = s / Σ_j s_j`` (normalised over all experts). Perfect balance
    gives ``L = 1``; the paper's weight ``α`` is ``model.moe.aux_loss_weight`` (it used 1e-4). ``[R]``.
    """
    logits, assigned, mask = _checked(logits, selected, mask)
    experts, top_k = logits.shape[-1], selected.shape[-1]
    fraction = _row_mean(assigned, mask) * (experts / top_k)
    scores = torch.sigmoid(logits)
    probability = _row_mean(scores / scores.sum(dim=-1, keepdim=True), mask)
    return (fraction * probability).sum(dim=-1)


def router_z_loss(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): ``L_z = (1/T) Σ_t (log Σ_i exp(logits_{t,i}))²``, per
    sequence ``[R]``. It keeps router logits small, so the router's softmax stays out of the range where bf16
    rounding flips choices. For sigmoid routers (DeepSeek-V3) it is applied to the same logits; the paper
    defines it for softmax routers only."""
    if logits.dim() != 3 or mask.shape != logits.shape[:2]:
        raise ValueError(f"router shapes: logits [R, T, E], mask [R, T]; got {tuple(logits.shape)}, {tuple(mask.shape)}")
    mask = mask.to(torch.float32)
    per_token = torch.logsumexp(logits.float(), dim=-1).square()
    return (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def aux_free_bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-AI 2024 §2.1.2; Wang et al. 2024): after each step,
    ``b_i ← b_i + γ · sign(mean_j c_j − c_i)`` with ``c_i`` the tokens routed to expert ``i`` over the step
    (every micro-batch and rank) and ``γ`` the bias update speed (``model.moe.bias_update_rate``; the paper
    used 0.001 for most of pre-training). An overloaded expert's bias falls, an underloaded one's rises, a
    balanced one's stays (``sign(0) = 0``). The bias is added to the scores for *choosing* experts only; the
    gate weights that mix the chosen experts' outputs come from the unbiased scores (transformers'
    ``DeepseekV3TopkRouter`` does exactly this). Returns the new bias ``[E]``; no gradient."""
    if bias.shape != load.shape or bias.dim() != 1:
        raise ValueError(f"bias and load must both be [E]; got {tuple(bias.shape)} and {tuple(load.shape)}")
    load = load.to(bias.device, torch.float64)
    return bias + (rate * torch.sign(load.mean() - load)).to(bias.dtype)


def load_entropy(load: torch.Tensor) -> torch.Tensor:
    """Entropy of the load distribution ``c_i / Σ c`` over ``E`` experts, divided by ``log E``: 1 when every
    expert gets the same number of tokens, 0 when one gets all of them."""
    load = load.double()
    share = load / load.sum().clamp(min=1.0)
    entropy = -(share * torch.log(share.clamp(min=1e-300))).sum()
    return entropy / torch.log(torch.tensor(float(max(load.numel(), 2)), dtype=torch.float64))
