"""Per-token RL losses: policy losses, KL-to-reference estimators, and loss aggregation, in registries.

The advantage estimators and the function that combines these pieces per micro-batch live in
``posttrain.algorithms.rl``; this module holds the per-token parts:

- ``POLICY_LOSSES``: ``f(logprobs [B,T], old_logprobs [B,T], advantages [B], mask [B,T], clip_low,
  clip_high) -> (per_token_loss [B,T], stats)``. ``stats`` are detached **sums over the masked tokens**
  (``loss_tokens``, ``clip_low_tokens``, ``clip_high_tokens``) so they add across micro-batches and ranks.
- ``KL_ESTIMATORS``: ``f(logprobs [B,T], ref_logprobs [B,T]) -> [B,T]``, per-token estimates of
  KL(π‖π_ref) from tokens sampled by the policy (Schulman 2020, "Approximating KL Divergence").
- ``AGGREGATIONS``: how a ``[B,T]`` per-token loss becomes the step's scalar, split into a micro-batch
  **numerator** (a sum) and a step **denominator** from global counts (``loss_units``), so gradient
  accumulation and rank count do not change the step.

Conventions shared by every function here: ``mask`` is bool (or 0/1 float) and marks the completion
tokens that carry loss. Masked-out positions contribute exactly 0 to the value *and* the gradient, even
if the log-probs there are ``-inf`` or NaN (padding): inputs are replaced by 0 there with ``torch.where``
before any arithmetic. Math runs in float32, or float64 when given float64 (bf16/fp16 inputs are cast up).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from posttrain.algorithms.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")
KL_ESTIMATORS: Registry = Registry("KL estimator")
AGGREGATIONS: Registry = Registry("loss aggregation")

# exp(±20) ≈ 5e8 (or 2e-9): a token whose log-ratio reaches this is far outside any trust region. The clamp
# keeps exp finite, so an extreme token cannot turn 0·inf into NaN in the backward pass (verl clamps alike).
MAX_LOG_RATIO = 20.0


# --- input checks -------------------------------------------------------------------------------


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32, or float64 when the input already is: the math never runs in bf16/fp16."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def as_mask(mask: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """``mask`` as a bool tensor of ``shape``; a float mask must hold only 0 and 1 (no silent weights)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask has shape {tuple(mask.shape)} but the per-token tensors have {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("mask must be bool or hold only 0 and 1; per-token weights are not a mask")
    return mask != 0


def token_tensor(name: str, tensor: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``[B,T]`` per-token tensor in ``dtype``, with masked-out positions replaced by exactly 0."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a [batch, tokens] tensor, got {shape}")
    if tensor.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)} but mask has {tuple(mask.shape)}")
    # where (not multiply): its backward hands exactly 0 to the masked positions, even where they hold inf/NaN.
    return torch.where(mask, tensor.to(dtype), torch.zeros((), dtype=dtype, device=tensor.device))


def _advantage_column(advantages: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(advantages, torch.Tensor) or advantages.dim() != 1 or advantages.shape[0] != batch:
        shape = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(f"advantages must be a [batch] tensor with one value per completion ({batch}), got {shape}")
    return advantages.detach().to(dtype).unsqueeze(1)


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not (0.0 <= clip_low < 1.0 and math.isfinite(clip_low)):
        raise ValueError(f"clip_low must be in [0, 1) (the ratio's lower bound is 1 - clip_low), got {clip_low}")
    if not (clip_high >= 0.0 and math.isfinite(clip_high)):
        raise ValueError(f"clip_high must be a finite number >= 0, got {clip_high}")


def _policy_inputs(logprobs, old_logprobs, advantages, mask):
    """Validated ``(mask, logprobs, old_logprobs or None, advantages [B,1])`` in the compute dtype."""
    if not isinstance(logprobs, torch.Tensor):
        raise ValueError(f"logprobs must be a [batch, tokens] tensor, got {type(logprobs).__name__}")
    dtype = compute_dtype(logprobs)
    mask = as_mask(mask, logprobs.shape)
    logp = token_tensor("logprobs", logprobs, mask, dtype)
    old = None if old_logprobs is None else token_tensor("old_logprobs", old_logprobs.detach(), mask, dtype)
    return mask, logp, old, _advantage_column(advantages, logp.shape[0], dtype)


def _count(condition: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return condition.sum().to(dtype).detach()


# --- policy losses ------------------------------------------------------------------------------


@POLICY_LOSSES.register("clipped")
def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO / GRPO clipped surrogate with decoupled bounds: ``ℓ_t = −min(ρ_t·A, clip(ρ_t, 1−ε_low, 1+ε_high)·A)``.

    ``ρ_t = exp(log π(y_t) − log π_old(y_t))`` is the token's ratio to the policy that sampled it, ``A``
    the completion's advantage broadcast over its tokens. Schulman et al. 2017 ("Proximal Policy
    Optimization Algorithms", eq. 7); Shao et al. 2024 (DeepSeekMath, GRPO) apply it per token with a
    group advantage; Yu et al. 2025 ("DAPO", clip-higher) decouple the bounds: a larger ``ε_high`` (0.28)
    lets low-probability tokens with ``A > 0`` grow further before the clip stops them, which keeps
    entropy from collapsing. ``clip_low == clip_high`` is PPO's symmetric clip.

    Where the clip binds the token's gradient is exactly 0: ``ρ > 1+ε_high`` with ``A > 0`` (counted in
    ``clip_high_tokens``) or ``ρ < 1−ε_low`` with ``A < 0`` (``clip_low_tokens``). The other two corners
    (``ρ`` small with ``A > 0``, ``ρ`` large with ``A < 0``) are not clipped: ``min`` keeps the pessimistic,
    unclipped term, as in PPO. On the first update after sampling ``ρ = 1`` and the gradient is
    REINFORCE's ``−A·∇log π``.

    Departures: the log-ratio is clamped to ±20 before ``exp`` (as verl) so an extreme token gives a
    finite loss instead of NaN gradients; no dual clip (Ye et al. 2020's bound on ``ρ·A`` for ``A < 0``,
    verl's ``clip_ratio_c``), so a token with ``A < 0`` and a large ratio is unbounded, as in TRL's
    default. Clip counts follow TRL's definition (the clip is *active*), not verl's ``pg_clipfrac``
    (which counts any token whose clipped term is larger, including some whose gradient is not zero).
    """
    _check_clip(clip_low, clip_high)
    if old_logprobs is None:
        raise ValueError("the clipped policy loss needs old_logprobs (the sampling policy's token log-probs)")
    mask, logp, old, adv = _policy_inputs(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(torch.clamp(logp - old, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = torch.where(mask, -torch.minimum(unclipped, clipped), torch.zeros_like(unclipped))
    with torch.no_grad():
        stats = {
            "loss_tokens": _count(mask, logp.dtype),
            "clip_low_tokens": _count(mask & (adv < 0) & (ratio < 1.0 - clip_low), logp.dtype),
            "clip_high_tokens": _count(mask & (adv > 0) & (ratio > 1.0 + clip_high), logp.dtype),
        }
    return per_token, stats


@POLICY_LOSSES.register("reinforce")
def reinforce_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.0,  # noqa: ARG001 - same signature as every policy loss; nothing is clipped
    clip_high: float = 0.0,  # noqa: ARG001
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain on-policy REINFORCE: ``ℓ_t = −A · exp(log π(y_t) − sg[log π(y_t)])``, so ``∇ℓ_t = −A·∇log π(y_t)``.

    Williams 1992 ("Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement
    Learning"); with a group baseline this is what nanochat's ``chat_rl.py`` and Ahmadian et al. 2024
    ("Back to Basics", RLOO) train. ``sg`` is stop-gradient (``detach``).

    Form chosen: the ratio to a detached copy of the current log-probs, rather than ``−A·log π``. Both
    have the same gradient, but this value is ``−A`` per token, which is what the clipped loss gives on
    an on-policy update (ratio 1): the logged loss means the same thing under either loss, and is not
    dominated by the magnitude of ``log π``. ``old_logprobs`` is ignored (it may be ``None``), and so
    are the clip bounds: this is the estimator for one update per rollout batch. With
    ``updates_per_rollout > 1`` later updates are off-policy and nothing corrects for it; use
    ``clipped`` there. The clip counts are reported as 0 so both losses give the same stats.
    """
    del old_logprobs
    mask, logp, _, adv = _policy_inputs(logprobs, None, advantages, mask)
    ratio = torch.exp(logp - logp.detach())  # exactly 1 in value; carries ∇log π
    per_token = torch.where(mask, -adv * ratio, torch.zeros_like(logp))
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    stats = {"loss_tokens": _count(mask, logp.dtype), "clip_low_tokens": zero, "clip_high_tokens": zero.clone()}
    return per_token, stats


# --- KL to the reference ------------------------------------------------------------------------
# Each estimator is evaluated at tokens y ~ π (strictly: ~ π_old, the sampling policy) with
# d = log π(y) − log π_ref(y). "As a loss" below means adding β·k(y) to the per-token loss and
# differentiating through log π(y) only, which is how GRPO (and TRL, verl's use_kl_loss) use them.
# The default is β = 0 (no KL term, no reference model), as in DAPO, Dr. GRPO and nanochat.


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k1 = log π − log π_ref``: unbiased for KL(π‖π_ref), high variance, negative on some tokens.

    Schulman 2020, "Approximating KL Divergence". Gradient caveat: as a loss its gradient is
    ``∇log π``, whose expectation under π is 0 — it does not pull π toward the reference at all in
    expectation. k1 is meant for reward shaping (PPO-RLHF subtracts β·k1 from the reward) and for
    logging; to penalise KL in the loss use ``k2`` (or ``k3``).
    """
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k2 = ½(log π − log π_ref)²``: biased for KL (low variance, ≥ 0; exact to second order).

    Schulman 2020, "Approximating KL Divergence". Gradient: ``(log π − log π_ref)·∇log π``, whose
    expectation under π is exactly ``∇KL(π‖π_ref)`` — as a loss, k2 gives the unbiased gradient of the
    reverse KL that the objective names (Tang & Munos 2025, "On a few pitfalls in KL divergence
    gradient estimation for RL"). Its *value* estimates a different divergence, so log k3 for the KL.
    """
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(log π_ref − log π) − (log π_ref − log π) − 1``: unbiased for KL(π‖π_ref), ≥ 0, low variance.

    Schulman 2020, "Approximating KL Divergence"; the GRPO paper's KL term (Shao et al. 2024, eq. 4) and
    TRL's. Gradient caveat: as a loss its gradient is ``(1 − π_ref/π)·∇log π``, whose expectation under
    π is ``−E_{π_ref}[∇log π] = ∇KL(π_ref‖π)`` — the gradient of the *forward* KL, not of the reverse
    KL(π‖π_ref) whose value it estimates (Tang & Munos 2025). Both vanish at π = π_ref, so it still
    regularises toward the reference; for the reverse-KL gradient use ``k2``. Departure: the exponent
    is clamped to ±20 (as verl) so one token cannot give inf; verl also clamps the result to ±10,
    which zeroes the gradient of exactly the tokens furthest from the reference — not done here.
    """
    log_ratio = torch.clamp(ref_logprobs - logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_per_token(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """``KL_ESTIMATORS[estimator]`` per token ``[B,T]``, in the compute dtype, exactly 0 at masked positions."""
    function = KL_ESTIMATORS.get(estimator)
    dtype = compute_dtype(logprobs)
    mask = as_mask(mask, logprobs.shape)
    logp = token_tensor("logprobs", logprobs, mask, dtype)
    ref = token_tensor("ref_logprobs", ref_logprobs.detach(), mask, dtype)
    value = function(logp, ref)
    return torch.where(mask, value, torch.zeros_like(value))


# --- aggregation --------------------------------------------------------------------------------


def loss_units(mask: torch.Tensor) -> tuple[int, int]:
    """``(tokens, sequences)`` that carry loss in ``mask [B,T]``: the counts every ``denominator`` takes.

    A sequence counts only if it has at least one loss token (a completion masked out entirely, e.g. a
    truncated one under overlong filtering, is not part of the loss; verl excludes it alike). Sum these
    over every micro-batch of an update on every rank to get the global counts.
    """
    mask = as_mask(mask, mask.shape)
    if mask.dim() != 2:
        raise ValueError(f"mask must be [batch, tokens], got shape {tuple(mask.shape)}")
    return int(mask.sum()), int(mask.any(dim=1).sum())


class Aggregation:
    """One way to reduce a ``[B,T]`` per-token loss to the step's scalar, as numerator ÷ denominator.

    - ``numerator(per_token_loss, mask, *, max_new_tokens=None) -> scalar Tensor``: this micro-batch's
      share, a **sum**; it is what the loss function the loop calls returns.
    - ``denominator(*, total_tokens, total_sequences) -> float``: the update's normaliser from the
      counts of ``loss_units`` summed over *all* micro-batches and ranks (``StepBatch.normalizer``).

    Σ over micro-batches and ranks of numerators ÷ denominator is the full-batch value exactly (up to
    float rounding), whatever the accumulation and rank count. ``aggregation(per_token_loss, mask, ...)``
    is that value for one batch on its own.
    """

    def __init__(self, numerator: Callable[..., torch.Tensor], per: str) -> None:
        if per not in ("tokens", "sequences"):
            raise ValueError(f"an aggregation normalises per 'tokens' or 'sequences', got {per!r}")
        self.numerator, self.per = numerator, per
        self.__doc__ = numerator.__doc__
        self.__qualname__ = numerator.__qualname__  # the registry names the function in its duplicate error

    def denominator(self, *, total_tokens: int | float, total_sequences: int | float) -> float:
        count = float(total_tokens if self.per == "tokens" else total_sequences)
        if not count > 0:
            raise ValueError(
                f"the {self.__qualname__} aggregation divides by the update's loss-bearing {self.per}, got {count}: "
                "every completion of the update is masked out (check the loss mask and overlong filtering)"
            )
        return count

    def __call__(self, per_token_loss: torch.Tensor, mask: torch.Tensor, *, max_new_tokens: int | None = None):
        tokens, sequences = loss_units(mask)
        numerator = self.numerator(per_token_loss, mask, max_new_tokens=max_new_tokens)
        return numerator / self.denominator(total_tokens=tokens, total_sequences=sequences)

    def __repr__(self) -> str:
        return f"Aggregation({self.__qualname__}, per {self.per})"


def _aggregation(name: str, per: str):
    def add(numerator):
        AGGREGATIONS.add(name, Aggregation(numerator, per))
        return numerator

    return add


def _masked_loss(per_token_loss: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = as_mask(mask, per_token_loss.shape)
    return token_tensor("per_token_loss", per_token_loss, mask, compute_dtype(per_token_loss)), mask


@_aggregation("token_mean", per="tokens")
def token_mean_numerator(per_token_loss: torch.Tensor, mask: torch.Tensor, *, max_new_tokens=None) -> torch.Tensor:
    """``token_mean``: ``L = Σ_{i,t} ℓ_{i,t} / N_tokens`` over the loss tokens of the whole update (all ranks).

    Numerator ``Σ_{i,t} m_{i,t}·ℓ_{i,t}``; denominator the update's loss-token count. Every token weighs
    the same, so long completions are not down-weighted (Yu et al. 2025, DAPO's "token-level policy
    gradient loss"; nanochat; TRL's ``dapo`` loss, verl's ``token-mean``). ``max_new_tokens`` is not read.
    """
    loss, _ = _masked_loss(per_token_loss, mask)
    return loss.sum()


@_aggregation("seq_mean_token_mean", per="sequences")
def seq_mean_token_mean_numerator(
    per_token_loss: torch.Tensor, mask: torch.Tensor, *, max_new_tokens=None
) -> torch.Tensor:
    """``seq_mean_token_mean``: ``L = (1/N_seq) Σ_i (1/|o_i|) Σ_t ℓ_{i,t}``, the GRPO paper's form.

    Shao et al. 2024 (DeepSeekMath, eq. 3). Numerator ``Σ_i mean_t ℓ_{i,t}`` (sequences without loss
    tokens add 0); denominator the update's count of sequences with loss tokens. Each completion weighs
    the same, so a token of a long completion weighs less — the length bias Liu et al. 2025 (Dr. GRPO)
    point out: long wrong answers are penalised less per token. Departure from TRL's ``grpo`` loss,
    which takes this mean per micro-batch and then averages micro-batches (so it changes with
    accumulation when micro-batches differ in size); here the mean is over the whole update.
    """
    loss, mask = _masked_loss(per_token_loss, mask)
    lengths = mask.sum(dim=1).clamp(min=1).to(loss.dtype)
    return (loss.sum(dim=1) / lengths).sum()


@_aggregation("seq_mean_token_sum_norm", per="sequences")
def seq_mean_token_sum_norm_numerator(
    per_token_loss: torch.Tensor, mask: torch.Tensor, *, max_new_tokens: int | None = None
) -> torch.Tensor:
    """``seq_mean_token_sum_norm`` (Dr. GRPO): ``L = (1/N_seq) Σ_i Σ_t ℓ_{i,t} / L_max``, ``L_max`` = ``max_new_tokens``.

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO): replace
    the per-completion ``1/|o_i|`` by one constant, so no length is favoured and the step size does not
    depend on how long this batch's completions happen to be. Numerator ``Σ_{i,t} ℓ_{i,t} / L_max``;
    denominator the update's count of sequences with loss tokens. Matches TRL's ``dr_grpo``
    (``Σ ℓ / (B·max_completion_length)``) except that B counts the whole update rather than one
    micro-batch; verl's mode divides by the constant but not by the sequence count.
    """
    if max_new_tokens is None or not max_new_tokens > 0:
        raise ValueError(
            f"seq_mean_token_sum_norm divides by the generation length cap: pass max_new_tokens > 0, got {max_new_tokens}"
        )
    loss, _ = _masked_loss(per_token_loss, mask)
    return loss.sum() / float(max_new_tokens)
