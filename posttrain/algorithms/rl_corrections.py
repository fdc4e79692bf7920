"""Training–inference mismatch corrections: per-token importance weights between trainer and sampler.

The tokens of a rollout are drawn from the **sampler's** distribution ``μ`` (its own kernels, precision,
batching: the "behaviour" policy, whose log-probs it records), while the loss is a function of the
**trainer's** distribution ``π``. Even with the same weights the two differ (Yao et al. 2025 show vLLM's
and FSDP's token probabilities disagree enough to make "on-policy" RL measurably off-policy). Policy lag
(``rl.max_staleness``) is another gap: ``π_old`` below is recomputed with the weights that sampled, so ``ρ``
measures only the engines' disagreement and the PPO ratio ``π_θ / π_old`` covers the lag. With ``ρ_t = π_old(y_t) / μ(y_t)``, the ratio of the trainer's probability of the
sampled token under the *sampling* weights to the sampler's own:

``IS_CORRECTIONS[name](train_logprobs [B,T], behaviour_logprobs [B,T], mask [B,T], *, cap, low, high, level)
-> (weights [B,T], stats)``

- ``train_logprobs``: ``log π_old(y_t)``, the trainer's log-probs recomputed with the weights that sampled
  the tokens; ``behaviour_logprobs``: ``log μ(y_t)``, the sampler's; ``mask``: the loss tokens.
- ``weights``: detached, in the compute dtype, exactly 0 off the mask; they multiply the policy-gradient
  term of the per-token loss (``rl_token_loss``), not the KL term.
- ``stats``: detached sums over the mask (so they add over micro-batches and ranks): ``is_weight_sum``
  (``Σ w``), ``is_truncated_tokens`` (tokens whose weight the cap lowered) and ``is_masked_tokens``
  (tokens whose weight the band zeroed).
- ``level``: ``token`` (one ``ρ_t`` per token) or ``sequence`` (``ρ_i = Π_t ρ_{i,t}`` over the
  completion's loss tokens, one weight for all of its tokens).

With the clipped loss and these weights the per-token loss is Yao et al.'s TIS-PPO,
``ℓ_t = −w_t · min(r_t·A, clip(r_t, 1−ε_low, 1+ε_high)·A)`` with ``r_t = π_θ(y_t) / π_old(y_t)``: the trust
region is around the trainer's own old policy and ``w_t`` carries the sampler's share.

Shared departures: ``log ρ`` is clamped to ±20 before ``exp`` (as the clipped loss), so ``C = ∞`` means
"no cap below e^20"; the weights carry no gradient (as in the papers and verl); a token zeroed by the band
keeps its place in the update's normaliser (verl's mask mode), so many masked tokens make a smaller step
rather than a renormalised one. The lower band and sequence-level variants follow verl's ``rollout_is``
options, not a paper's experiments.
"""

from __future__ import annotations

import math

import torch

from posttrain.algorithms.registry import Registry
from posttrain.algorithms.rl_losses import MAX_LOG_RATIO, as_mask, compute_dtype, token_tensor

IS_CORRECTIONS: Registry = Registry("importance-sampling correction")
LEVELS = ("token", "sequence")


def log_ratios(train_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
               level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, log ρ [B,T])`` in the compute dtype: per token, or (``sequence``) each completion's
    ``Σ_t log ρ_{i,t}`` over its loss tokens, broadcast to them; 0 off the mask, clamped to ±20."""
    if level not in LEVELS:
        raise ValueError(f"importance-sampling level must be one of {', '.join(LEVELS)}, got {level!r}")
    dtype = compute_dtype(train_logprobs)
    mask = as_mask(mask, train_logprobs.shape)
    train = token_tensor("train_logprobs", train_logprobs.detach(), mask, dtype)
    behaviour = token_tensor("behaviour_logprobs", behaviour_logprobs.detach(), mask, dtype)
    log_rho = train - behaviour
    if level == "sequence":
        log_rho = torch.where(mask, log_rho.sum(dim=1, keepdim=True).expand_as(log_rho), torch.zeros_like(log_rho))
    return mask, torch.clamp(log_rho, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def _stats(mask: torch.Tensor, weights: torch.Tensor, truncated: torch.Tensor, masked: torch.Tensor):
    dtype = weights.dtype
    return {"is_weight_sum": weights.sum().detach(), "is_truncated_tokens": (mask & truncated).sum().to(dtype),
            "is_masked_tokens": (mask & masked).sum().to(dtype)}


@IS_CORRECTIONS.register("none")
def no_correction(train_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
                  cap: float = math.inf, low: float = 0.0, high: float = math.inf,  # noqa: ARG001 - one signature
                  level: str = "token") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``w_t = 1`` on every loss token: the sampler's tokens are trained as if the trainer had drawn them.

    ``rl_token_loss`` does not even call this (multiplying by 1 changes nothing); with it the ratio's old
    log-probs are the sampler's own (``rl.is_correction: none``), so the mismatch sits inside the PPO ratio.
    """
    mask, log_rho = log_ratios(train_logprobs, behaviour_logprobs, mask, level)
    weights = mask.to(log_rho.dtype)
    none = torch.zeros_like(mask)
    return weights, _stats(mask, weights, none, none)


@IS_CORRECTIONS.register("tis")
def truncated_importance_sampling(train_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                                  *, cap: float = 2.0, low: float = 0.0, high: float = math.inf,  # noqa: ARG001
                                  level: str = "token") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TIS: ``w_t = min(ρ_t, C)``, ``ρ_t = exp(log π_old(y_t) − log μ(y_t))``; ``sequence``: ``w_i = min(Π_t ρ_{i,t}, C)``.

    Yao, Liu, Zhang, Dong, Shang & Gao 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (the Flash-RL blog; TIS as in Ionides 2008's truncated importance sampling): the gradient
    ``E_μ[min(ρ, C)·∇ℓ]`` is the on-policy one up to the truncation, whose bias is bounded while the
    variance of an unbounded ``ρ`` is not. They use ``C = 2`` (the default ``rl.is_cap``). ``C = ∞``
    is plain importance sampling: with the clipped loss it gives ``ρ_t · r_t = π_θ/μ``, the
    uncorrected ratio to the sampler, wherever the clip does not bind (tested). Only the top is
    truncated (Yao et al.; ``low``/``high`` are not read): a token the sampler over-weights gets a small
    weight, which is the correction working. ``cap`` must be ≥ 1 so an on-policy token keeps weight 1.
    """
    if not cap >= 1.0:
        raise ValueError(f"the TIS cap C must be >= 1 (math.inf for none), got {cap}")
    mask, log_rho = log_ratios(train_logprobs, behaviour_logprobs, mask, level)
    rho = torch.exp(log_rho)
    weights = torch.where(mask, torch.clamp(rho, max=cap), torch.zeros_like(rho))
    return weights, _stats(mask, weights, rho > cap, torch.zeros_like(mask))


@IS_CORRECTIONS.register("mis")
def masked_importance_sampling(train_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                               *, cap: float = math.inf, low: float = 0.5, high: float = 2.0,  # noqa: ARG001
                               level: str = "token") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MIS: ``w_t = ρ_t · 1[low ≤ ρ_t ≤ high]``; ``sequence``: ``w_i = ρ_i · 1[low ≤ ρ_i ≤ high]``, ``ρ_i = Π_t ρ_{i,t}``.

    Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
    Mismatch" (sequence-level masked IS) and verl's ``rollout_is`` mask mode: a token (or completion) whose
    ratio leaves the band is rejected — weight exactly 0 — instead of being truncated as in TIS, because a
    large ratio marks a token the two engines disagree on, whose gradient is noise; inside the band the
    importance weight is kept. ``0 ≤ low ≤ 1 ≤ high`` so an on-policy token is never masked (``cap`` is not
    read). Departure: ``ρ_i`` is the product over the whole completion, which for long completions leaves
    any band quickly; verl's ``geometric`` level (``exp(mean_t log ρ)``) is not implemented.
    """
    if not (0.0 <= low <= 1.0 <= high):
        raise ValueError(f"the MIS band [low, high] must hold 1 (0 <= low <= 1 <= high), got [{low}, {high}]")
    mask, log_rho = log_ratios(train_logprobs, behaviour_logprobs, mask, level)
    rho = torch.exp(log_rho)
    outside = (rho < low) | (rho > high)
    weights = torch.where(mask & ~outside, rho, torch.zeros_like(rho))
    return weights, _stats(mask, weights, torch.zeros_like(mask), outside)


def mismatch_figures(train_logprobs: list[list[float]], behaviour_logprobs: list[list[float]]) -> dict[str, float]:
    """What a step logs about the mismatch, from per-completion lists of the two log-probs (host floats):
    ``rollout/logprob_abs_diff`` (mean over tokens) and ``…_max`` of ``|log π_old − log μ|``, and the
    largest and smallest token ratio ``ρ_t`` (``rollout/is_ratio_max`` / ``…_min``). Empty input → {}."""
    diffs = [t - b for train, behaviour in zip(train_logprobs, behaviour_logprobs, strict=True)
             for t, b in zip(train, behaviour, strict=True)]
    if not diffs:
        return {}
    values = torch.tensor(diffs, dtype=torch.float64)
    ratio = torch.exp(torch.clamp(values, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    return {"rollout/logprob_abs_diff": float(values.abs().mean()), "rollout/logprob_abs_diff_max":
            float(values.abs().max()), "rollout/is_ratio_max": float(ratio.max()), "rollout/is_ratio_min":
            float(ratio.min())}
