"""The math of value-free RL (GRPO and its family): advantages here; per-token losses in ``rl_losses``.

No critic: the other completions sampled for the same prompt (its *group*) are the baseline. A step is

1. ``ADVANTAGES[name](rewards [n], group_ids [n]) -> [n]``: one advantage per completion, computed over
   the step's **global** batch of rewards (every rank's completions, so 2 ranks == 1 rank);
2. per micro-batch, ``rl_token_loss(...) -> (per_token_loss [B,T], stats)``: the policy loss
   (``POLICY_LOSSES``) with the advantage broadcast over the completion's tokens, times the
   training–inference mismatch weights (``IS_CORRECTIONS``, off by default), plus ``β·KL`` to a
   reference (``KL_ESTIMATORS``, off by default);
3. ``AGGREGATIONS[name]``: the micro-batch's ``numerator`` (a sum, what the loss function returns) and the
   update's ``denominator`` from ``loss_units`` counted over all micro-batches and ranks (the normaliser).

Everything here is a pure function of tensors; see ``docs/rl.md`` ("The math") for the choices and papers.
This module re-exports the ``rl_losses`` names, so ``posttrain.algorithms.rl`` is the one import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from posttrain.algorithms.registry import Registry
from posttrain.algorithms.rl_corrections import IS_CORRECTIONS, mismatch_figures  # noqa: F401 - re-exported
from posttrain.algorithms.rl_losses import (  # noqa: F401 - re-exported: one import for the RL math
    AGGREGATIONS,
    KL_ESTIMATORS,
    MAX_LOG_RATIO,
    POLICY_LOSSES,
    Aggregation,
    as_mask,
    compute_dtype,
    kl_per_token,
    loss_units,
)

ADVANTAGES: Registry = Registry("advantage estimator")


# --- group statistics ---------------------------------------------------------------------------


class _Groups:
    """Per-completion views of group statistics for arbitrary (non-contiguous, unequal) group ids."""

    def __init__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
        if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
            shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
            raise ValueError(f"rewards must be a [n] tensor with one reward per completion, got {shape}")
        if not isinstance(group_ids, torch.Tensor) or group_ids.shape != rewards.shape:
            shape = tuple(group_ids.shape) if isinstance(group_ids, torch.Tensor) else type(group_ids).__name__
            raise ValueError(f"group_ids must be a [n] tensor like rewards {tuple(rewards.shape)}, got {shape}")
        if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
            raise ValueError(f"group_ids must be an integer tensor (one prompt id per completion), got {group_ids.dtype}")
        self.rewards = rewards.detach().to(compute_dtype(rewards))
        if not bool(torch.isfinite(self.rewards).all()):
            raise ValueError("rewards must be finite; give a failed or timed-out reward 0 before computing advantages")
        _, self.index = torch.unique(group_ids, return_inverse=True)
        self.num_groups = int(self.index.max()) + 1 if self.index.numel() else 0
        self.size = self._per_item(torch.ones_like(self.rewards), "sum")

    def _per_item(self, values: torch.Tensor, reduce: str) -> torch.Tensor:
        """Reduce ``values`` within each group and hand every completion its group's result."""
        out = torch.zeros(self.num_groups, dtype=values.dtype, device=values.device)
        out = out.scatter_reduce(0, self.index, values, reduce=reduce, include_self=False)
        return out[self.index]

    def total(self) -> torch.Tensor:
        return self._per_item(self.rewards, "sum")

    def mean(self) -> torch.Tensor:
        return self.total() / self.size

    def unbiased_std(self) -> torch.Tensor:
        """Sample std with Bessel's correction ``√(Σ(r − mean)² / (G − 1))``; 0 for a group of one."""
        squares = self._per_item((self.rewards - self.mean()) ** 2, "sum")
        return torch.sqrt(squares / (self.size - 1).clamp(min=1))

    def constant(self) -> torch.Tensor:
        """True for completions whose group's rewards are all equal (including groups of one)."""
        return self._per_item(self.rewards, "amax") == self._per_item(self.rewards, "amin")


def _zero_signal(groups: _Groups, advantages: torch.Tensor) -> torch.Tensor:
    # A group whose rewards are all equal carries no signal; rounding in its mean (3 × 0.1 / 3 ≠ 0.1)
    # must not hand it a tiny advantage that the std division then blows up. Exactly 0 instead.
    return torch.where(groups.constant(), torch.zeros_like(advantages), advantages)


# --- advantage estimators -----------------------------------------------------------------------


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``A_i = (r_i − mean_g) / (std_g + ε)`` over the completions ``g`` of the same prompt.

    Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
    Models", §4.1.2 (outcome supervision). ``std_g`` is the sample std with Bessel's correction
    (``G − 1``), as TRL, verl and OpenRLHF compute it, so advantages — and with them learning rates and
    clip ranges — transfer from those frameworks unchanged; the paper does not say which. (With G = 2 and
    rewards {0, 1} this gives ±0.707; the population std would give ±1.)

    A group of one, or whose rewards are all equal, gets exactly 0. Departures: verl gives a group of
    one its raw reward (baseline 0, std 1) — here it has no baseline to compare with, so no signal; TRL
    uses ε = 1e-4, verl 1e-6 (the default here).
    """
    groups = _Groups(rewards, group_ids)
    centred = groups.rewards - groups.mean()
    return _zero_signal(groups, centred / (groups.unbiased_std() + eps))


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # noqa: ARG001
    """Dr. GRPO: ``A_i = r_i − mean_g`` — GRPO without the std division.

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective": dividing by the
    group's std up-weights prompts that are nearly always solved or nearly always failed (small std), a
    difficulty bias; removing it (with ``seq_mean_token_sum_norm`` for the length bias) gives an unbiased
    policy gradient. nanochat's ``chat_rl.py`` uses the same advantage. A group of one, or with equal
    rewards, gets exactly 0. ``eps`` is not read (same signature as every estimator).
    """
    groups = _Groups(rewards, group_ids)
    return _zero_signal(groups, groups.rewards - groups.mean())


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # noqa: ARG001
    """RLOO: ``A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j``, the mean of the *other* completions as the baseline.

    Kool, van Hoof & Welling 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al.
    2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in
    LLMs". The baseline does not depend on ``r_i``, so the gradient estimate is unbiased; it equals
    ``G/(G−1)·(r_i − mean_g)``. A group of one (no other completion) or with equal rewards gets exactly 0.
    Departure from verl, which gives a group of one its raw reward. ``eps`` is not read.
    """
    groups = _Groups(rewards, group_ids)
    others = (groups.total() - groups.rewards) / (groups.size - 1).clamp(min=1)
    return _zero_signal(groups, groups.rewards - others)


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++-baseline: ``x_i = r_i − mean_g``, then ``A_i = (x_i − mean(x)) / (std(x) + ε)`` over the batch.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models" (the
    ``-baseline`` variant for prompts with several samples): the group mean removes the prompt's
    difficulty, and whitening over the whole batch (not per group) sets the scale without GRPO's
    per-prompt std bias. Call it on the step's global rewards: "the batch" is what it is given.
    ``std(x)`` is the population std over all completions (as OpenRLHF, the authors' code), so the
    whitened batch has exactly unit variance. Since every group's ``x`` sums to 0, ``mean(x)`` is 0 up to
    rounding and whitening only rescales. Completions in a group with equal rewards get exactly 0.

    Departure: verl and OpenRLHF whiten over *tokens* (each completion weighted by its length); here
    each completion counts once, as its advantage is one number per completion.
    """
    groups = _Groups(rewards, group_ids)
    centred = groups.rewards - groups.mean()
    if centred.numel() == 0:
        return centred
    whitened = (centred - centred.mean()) / (centred.std(correction=0) + eps)
    return _zero_signal(groups, whitened)


# --- the per-micro-batch loss -------------------------------------------------------------------


def rl_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    policy_loss: str = "clipped",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    behaviour_logprobs: torch.Tensor | None = None,
    is_correction: str = "none",
    is_cap: float = math.inf,
    is_band: tuple[float, float] = (0.0, math.inf),
    is_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``ℓ_{i,t} = policy_loss_{i,t} + β·KL_{i,t}`` per token ``[B,T]``, and the micro-batch's stat sums.

    ``logprobs [B,T]`` of the completion tokens under the model being trained (with grad);
    ``old_logprobs [B,T]`` under the policy that sampled them (``None`` only for ``reinforce``);
    ``advantages [B]`` one per completion (``ADVANTAGES``); ``mask [B,T]`` the loss tokens;
    ``ref_logprobs [B,T]`` under the reference model, needed when ``kl_beta > 0``.

    The KL term is off by default (β = 0: no reference model is needed or loaded), as in DAPO (Yu et al.
    2025), Dr. GRPO and nanochat; the GRPO paper used β = 0.04 with ``k3``. With ``ref_logprobs`` given
    the KL is measured (``kl_sum``) even at β = 0. Reduce ``per_token_loss`` with an ``AGGREGATIONS``
    entry. Stats (detached sums over the masked tokens, so they add over micro-batches and ranks):
    ``loss_tokens``, ``clip_low_tokens``, ``clip_high_tokens`` and, with a reference, ``kl_sum``;
    ``clip_fractions`` turns the summed stats into fractions.

    Training–inference mismatch (``rl_corrections``): with ``is_correction`` other than ``none``,
    ``old_logprobs`` are the *trainer's* log-probs under the sampling weights and ``behaviour_logprobs
    [B,T]`` the sampler's; the policy term is multiplied by ``IS_CORRECTIONS[is_correction]``'s weights
    (cap ``is_cap`` for ``tis``, band ``is_band`` for ``mis``, per ``is_level``), the KL term is not, and
    the stats gain ``is_weight_sum``, ``is_truncated_tokens``, ``is_masked_tokens``. With ``none`` nothing
    is computed and ``old_logprobs`` are whatever the caller passes (the sampler's, in ``posttrain grpo``).
    """
    if not kl_beta >= 0.0:
        raise ValueError(f"kl_beta must be >= 0 (0 turns the KL term off), got {kl_beta}")
    if kl_beta > 0 and ref_logprobs is None:
        raise ValueError(
            f"kl_beta={kl_beta} needs ref_logprobs (the reference model's token log-probs); set kl_beta: 0 to train "
            "without a reference model"
        )
    per_token, stats = POLICY_LOSSES.get(policy_loss)(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    if is_correction != "none":
        if old_logprobs is None or behaviour_logprobs is None:
            raise ValueError(f"is_correction={is_correction!r} needs old_logprobs (the trainer's, under the sampling "
                             "weights) and behaviour_logprobs (the sampler's)")
        weights, is_stats = IS_CORRECTIONS.get(is_correction)(
            old_logprobs, behaviour_logprobs, mask, cap=is_cap, low=is_band[0], high=is_band[1], level=is_level)
        per_token = per_token * weights.to(per_token.dtype)
        stats.update(is_stats)
    if ref_logprobs is not None:
        kl = kl_per_token(logprobs, ref_logprobs, mask, kl_estimator)
        stats["kl_sum"] = kl.detach().sum()
        if kl_beta > 0:
            per_token = per_token + kl_beta * kl
    return per_token, stats


def clip_fractions(stat_sums: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """Fractions of loss tokens from ``rl_token_loss`` stats summed over micro-batches and ranks.

    ``clip_fraction/low`` (ratio below ``1 − clip_low`` with ``A < 0``), ``clip_fraction/high`` (above
    ``1 + clip_high`` with ``A > 0``), ``clip_fraction`` (either: the tokens whose gradient the clip
    zeroed) and, when ``kl_sum`` is present, ``kl`` (the mean per-token KL estimate). Empty input → 0.
    """
    tokens = float(stat_sums.get("loss_tokens", 0.0))
    low, high = float(stat_sums.get("clip_low_tokens", 0.0)), float(stat_sums.get("clip_high_tokens", 0.0))
    scale = 1.0 / tokens if tokens > 0 else 0.0
    out = {"clip_fraction/low": low * scale, "clip_fraction/high": high * scale, "clip_fraction": (low + high) * scale}
    if "kl_sum" in stat_sums:
        out["kl"] = float(stat_sums["kl_sum"]) * scale
    return out


# --- reward shaping -----------------------------------------------------------------------------


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), as a non-negative amount to subtract.

    With ``L = max_new_tokens`` and a buffer of ``B`` tokens::

        0                                   if length <= L - B
        penalty * (length - (L - B)) / B    if L - B < length <= L

    so a completion is punished more the deeper it runs into the last ``B`` tokens before the cap, and a
    completion at the cap loses ``penalty``. DAPO's third case (``length > L``: −1) cannot happen here:
    generation stops at ``L``. ``B = 0`` turns the shaping off.
    """
    if buffer <= 0:
        return 0.0
    if buffer >= max_new_tokens:
        raise ValueError(f"the overlong buffer ({buffer}) must be shorter than max_new_tokens ({max_new_tokens})")
    over = length - (max_new_tokens - buffer)
    return penalty * min(max(over, 0), buffer) / buffer
