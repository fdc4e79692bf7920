"""DPO-family preference losses: pure functions over per-sequence log-probs, in one registry.

Every loss in ``LOSSES`` has the signature::

    f(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
      beta, label_smoothing=0.0, chosen_lengths=None, rejected_lengths=None, **params) -> [B]

All log-prob tensors are ``[B]`` float32 sums of the response tokens' log-probs (prompt tokens
excluded). ``chosen_lengths`` / ``rejected_lengths`` are ``[B]`` response token counts, needed by the
length-normalised losses. The result is the per-pair loss ``[B]``; the trainer reduces it (mean over
the global batch). Reference-free losses accept ``None`` for the reference arguments and ignore them.
Losses ignore keyword parameters they do not use, so several can be combined with one call
(``combine_losses``); ``LOSS_SPECS`` records which parameters and inputs each one actually reads, so a
config layer can reject a parameter that no chosen loss would use.

Notation in the docstrings: ``π_c, π_r`` policy log-prob sums of chosen / rejected; ``ρ_c = π_c − ref_c``,
``ρ_r = π_r − ref_r`` the log-ratios to the reference; ``h = ρ_c − ρ_r``; ``|y|`` response length;
``σ`` the logistic function; ``ε`` = ``label_smoothing``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from posttrain.algorithms.preference_specs import LOSS_SPECS, LossSpec, check_loss_params  # noqa: F401 - re-exported
from posttrain.algorithms.registry import Registry

LOSSES: Registry = Registry("preference loss")


def _loss(name: str):
    """Register a loss function under ``name``; what it reads is declared in ``LOSS_SPECS`` (torch-free)."""

    def add(function):
        if name not in LOSS_SPECS:
            raise ValueError(f"preference loss {name!r} has no row in posttrain.algorithms.preference_specs.LOSS_SPECS")
        LOSSES.add(name, function)
        return function

    return add


# --- input checks -------------------------------------------------------------------------------


def _as_f32(name: str, tensor: torch.Tensor | None, like: torch.Tensor | None = None) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"{name} is required by this loss but was None")
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.as_tensor(
            tensor, dtype=torch.float32, device=like.device if like is not None else None
        )
    if tensor.dim() != 1:
        raise ValueError(
            f"{name} must be a [batch] tensor of per-sequence values, got shape {tuple(tensor.shape)}"
        )
    if like is not None and tensor.shape != like.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but the policy log-probs have {tuple(like.shape)}"
        )
    return tensor.float()


def _policy(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = _as_f32("policy_chosen_logps", chosen)
    return chosen, _as_f32("policy_rejected_logps", rejected, chosen)


def _log_ratios(loss: str, pc, pr, rc, rr) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ρ_c, ρ_r)``; a clear error when a reference-based loss gets no reference."""
    if rc is None or rr is None:
        raise ValueError(
            f"preference loss {loss!r} needs reference log-probs (ref_chosen_logps, ref_rejected_logps); "
            "use dpo.reference: precomputed or live, or a reference-free loss (simpo, orpo)"
        )
    return pc - _as_f32("ref_chosen_logps", rc, pc), pr - _as_f32("ref_rejected_logps", rr, pr)


def _lengths(
    loss: str, chosen_lengths, rejected_lengths, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if chosen_lengths is None or rejected_lengths is None:
        raise ValueError(
            f"preference loss {loss!r} is length-normalised: pass chosen_lengths and rejected_lengths "
            "(the number of response tokens of each sequence)"
        )
    lc = _as_f32("chosen_lengths", chosen_lengths, like)
    lr = _as_f32("rejected_lengths", rejected_lengths, like)
    if _host_readable(lc) and (bool((lc <= 0).any()) or bool((lr <= 0).any())):
        raise ValueError(f"preference loss {loss!r}: every response length must be at least 1 token")
    return lc, lr


def _host_readable(tensor: torch.Tensor) -> bool:
    """Whether a value check on ``tensor`` is free: on the CPU it is; on an accelerator reading it waits
    for the device (a host sync per micro-batch), so there the lengths are checked where they are built,
    from host integers (``posttrain.train.pairs.collate_pairs``)."""
    return tensor.device.type == "cpu"


def _check_smoothing(loss: str, epsilon: float, upper: float) -> None:
    if not 0.0 <= epsilon < upper:
        raise ValueError(f"preference loss {loss!r}: label_smoothing must be in [0, {upper}), got {epsilon}")


# --- reference-based losses ----------------------------------------------------------------------


@_loss("sigmoid")
def dpo_sigmoid_loss(
    policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, **_
) -> torch.Tensor:
    """DPO: ``L = −log σ(β·h)``, ``h = (π_c − ref_c) − (π_r − ref_r)``.

    Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
    Model", eq. 7. ``label_smoothing`` is not read here: the label-smoothed form is ``cdpo``.
    """
    pc, pr = _policy(policy_chosen_logps, policy_rejected_logps)
    rho_c, rho_r = _log_ratios("sigmoid", pc, pr, ref_chosen_logps, ref_rejected_logps)
    return -F.logsigmoid(beta * (rho_c - rho_r))


@_loss("cdpo")
def conservative_dpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    *,
    beta,
    label_smoothing=0.0,
    **_,
) -> torch.Tensor:
    """Conservative DPO: ``L = −(1−ε)·log σ(β·h) − ε·log σ(−β·h)``.

    DPO with labels smoothed toward "the preference is flipped with probability ε": the optimum
    stops at a finite margin instead of pushing ``h`` to infinity. Mitchell 2023, "A note on DPO
    with noisy preferences & relationship to IPO". ``0 ≤ ε < 0.5``; ``ε = 0`` is plain DPO.
    """
    _check_smoothing("cdpo", label_smoothing, 0.5)
    pc, pr = _policy(policy_chosen_logps, policy_rejected_logps)
    rho_c, rho_r = _log_ratios("cdpo", pc, pr, ref_chosen_logps, ref_rejected_logps)
    logits = beta * (rho_c - rho_r)
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


@_loss("robust")
def robust_dpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    *,
    beta,
    label_smoothing=0.0,
    **_,
) -> torch.Tensor:
    """Robust DPO (rDPO): ``L = [−(1−ε)·log σ(β·h) + ε·log σ(−β·h)] / (1 − 2ε)``.

    An unbiased estimate of the clean-label DPO loss when each label was flipped with known rate
    ``ε`` (= ``label_smoothing``, ``0 ≤ ε < 0.5``). Chowdhury, Kini & Natarajan 2024, "Provably
    Robust DPO: Aligning Language Models with Noisy Feedback". Unlike ``cdpo`` the flipped
    term enters with a minus sign, so the loss can be negative; its gradient always widens ``h``.
    """
    _check_smoothing("robust", label_smoothing, 0.5)
    pc, pr = _policy(policy_chosen_logps, policy_rejected_logps)
    rho_c, rho_r = _log_ratios("robust", pc, pr, ref_chosen_logps, ref_rejected_logps)
    logits = beta * (rho_c - rho_r)
    clean = -(1 - label_smoothing) * F.logsigmoid(logits)
    flipped = label_smoothing * F.logsigmoid(-logits)
    return (clean + flipped) / (1 - 2 * label_smoothing)


@_loss("hinge")
def hinge_loss(
    policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, **_
) -> torch.Tensor:
    """SLiC hinge: ``L = max(0, 1 − β·h)``.

    Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human Feedback", calibration
    loss ``max(0, δ − log π(y_w|x) + log π(y_l|x))``. Departure: as in Liu et al. 2023 ("Statistical
    Rejection Sampling Improves Preference Optimization", RSO) and TRL, the margin is on the
    reference log-ratio ``h`` rather than on raw policy log-probs, with ``δ = 1/β`` (scaled by β);
    SLiC's separate regulariser toward the SFT targets is not included (use ``sft_weight``).
    """
    pc, pr = _policy(policy_chosen_logps, policy_rejected_logps)
    rho_c, rho_r = _log_ratios("hinge", pc, pr, ref_chosen_logps, ref_rejected_logps)
    return torch.relu(1 - beta * (rho_c - rho_r))


@_loss("ipo")
def ipo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    *,
    beta,
    chosen_lengths=None,
    rejected_lengths=None,
    **_,
) -> torch.Tensor:
    """IPO: ``L = (h̄ − 1/(2β))²`` with ``h̄ = ρ_c/|y_c| − ρ_r/|y_r|`` (β is the paper's τ).

    Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", eq. 17. Convention chosen: the log-ratios are averaged per response token, as in
    TRL (whose authors confirmed with the IPO authors that the paper's results used this form).
    The paper writes sequence sums; with sums the squared loss grows with response length and the
    target margin ``1/(2β)`` means something different for every length. Needs the lengths.
    Unlike the logistic losses, IPO pulls ``h̄`` *toward* ``1/(2β)``: past it, the gradient narrows it.
    """
    pc, pr = _policy(policy_chosen_logps, policy_rejected_logps)
    rho_c, rho_r = _log_ratios("ipo", pc, pr, ref_chosen_logps, ref_rejected_logps)
    lc, lr = _lengths("ipo", chosen_lengths, rejected_lengths, pc)
    return (rho_c / lc - rho_r / lr - 1 / (2 * beta)) ** 2


@_loss("apo_zero")
def apo_zero_loss(
    policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, **_
) -> torch.Tensor:
    """APO-zero: ``L = (1 − σ(β·ρ_c)) + σ(β·ρ_r)``.

    D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive Revisions".
    Anchored: it raises the chosen likelihood and lowers the rejected one *each against the
    reference*, not only their difference — for when chosen answers are better than the current
    model's own outputs.
    """
    pc, pr = _policy(policy_chosen_logps, policy_rejected_logps)
    rho_c, rho_r = _log_ratios("apo_zero", pc, pr, ref_chosen_logps, ref_rejected_logps)
    return (1 - torch.sigmoid(beta * rho_c)) + torch.sigmoid(beta * rho_r)


@_loss("bco_pair")
def bco_pair_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    *,
    beta,
    bco_delta=0.0,
    **_,
) -> torch.Tensor:
    """BCO on pairs: ``L = −log σ(β·ρ_c − δ) − log σ(−(β·ρ_r − δ))``.

    Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment":
    a binary classifier whose logit is the implicit reward ``β·ρ``, chosen = 1, rejected = 0, with
    the reward shift ``δ`` (``bco_delta``). The paper (and TRL) keep δ as a running mean of the
    rewards ``β·ρ`` over chosen and rejected of past batches; here δ is an explicit argument so the
    function stays pure — ``posttrain dpo`` keeps δ as step-source state and folds in each accepted
    step's rewards with ``fold_running_mean`` after the step, so one δ holds for a whole step (a
    departure from TRL, which updates it per micro-batch: here accumulation and rank count do not
    change the step). ``δ = 0`` (default) is the unshifted classifier.
    """
    pc, pr = _policy(policy_chosen_logps, policy_rejected_logps)
    rho_c, rho_r = _log_ratios("bco_pair", pc, pr, ref_chosen_logps, ref_rejected_logps)
    return -F.logsigmoid(beta * rho_c - bco_delta) - F.logsigmoid(-(beta * rho_r - bco_delta))


def fold_running_mean(mean: float, count: int, total: float, n: int) -> tuple[float, int]:
    """Fold ``n`` new values whose sum is ``total`` into a running mean: returns ``(new_mean, new_count)``.

    For BCO's δ: ``total`` = Σ β·ρ over the chosen and rejected responses of a step's pairs on all ranks,
    ``n`` = twice the step's pair count, so every rank keeps the same δ.
    """
    if n <= 0:
        return mean, count
    new_count = count + n
    return mean + (total - n * mean) / new_count, new_count


def update_running_mean(mean: float, count: int, values: torch.Tensor) -> tuple[float, int]:
    """``fold_running_mean`` over a tensor of values."""
    values = values.detach().float().flatten()
    return fold_running_mean(mean, count, float(values.sum()), values.numel())


# --- reference-free losses ----------------------------------------------------------------------


@_loss("simpo")
def simpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps=None,
    ref_rejected_logps=None,
    *,
    beta,
    chosen_lengths=None,
    rejected_lengths=None,
    simpo_gamma=0.5,
    **_,
) -> torch.Tensor:
    """SimPO: ``L = −log σ(β·π_c/|y_c| − β·π_r/|y_r| − γ)``; reference-free, γ = ``simpo_gamma``.

    Meng, Xia & Chen 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward".
    The implicit reward is the length-normalised log-likelihood ``β·π/|y|``; γ is the target
    reward margin, on the reward scale (the same γ as TRL's CPO ``simpo_gamma``, default 0.5).
    Note the paper's β is on another scale than DPO's (typically 2–10, not 0.1). The reference
    arguments are ignored. ``label_smoothing`` is not read.
    """
    pc, pr = _policy(policy_chosen_logps, policy_rejected_logps)
    lc, lr = _lengths("simpo", chosen_lengths, rejected_lengths, pc)
    return -F.logsigmoid(beta * (pc / lc) - beta * (pr / lr) - simpo_gamma)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − exp(x))`` for ``x < 0``, stable at both ends (Mächler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


# An average token log-prob of exactly 0 (probability 1) gives infinite odds; clamp just below it.
_MAX_MEAN_LOGP = -1e-6


@_loss("orpo")
def orpo_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    ref_chosen_logps=None,
    ref_rejected_logps=None,
    *,
    beta=None,
    chosen_lengths=None,
    rejected_lengths=None,
    orpo_lambda=0.1,
    **_,
) -> torch.Tensor:
    """ORPO: ``L = −π_c/|y_c| + λ·(−log σ(log odds(y_c) − log odds(y_r)))``; reference-free.

    Hong, Lee & Thorne 2024, "ORPO: Monolithic Preference Optimization without Reference Model",
    eqs. 4–7. ``odds(y) = P/(1 − P)`` with ``P = exp(π/|y|)`` the per-token (geometric-mean)
    likelihood, so ``log odds = a − log(1 − e^a)`` with ``a = π/|y|``. The NLL term on the chosen
    response is *included* with weight 1, as in the paper: ORPO is meant to replace SFT + alignment
    in one loss, so do not add ``sft_weight`` on top unless you want a larger NLL weight.
    λ = ``orpo_lambda`` (paper and TRL default 0.1). ``beta`` is not read: TRL's ORPO calls λ
    "beta"; here the name says what it is. Needs the lengths; reference arguments are ignored.
    """
    pc, pr = _policy(policy_chosen_logps, policy_rejected_logps)
    lc, lr = _lengths("orpo", chosen_lengths, rejected_lengths, pc)
    mean_c = (pc / lc).clamp(max=_MAX_MEAN_LOGP)
    mean_r = (pr / lr).clamp(max=_MAX_MEAN_LOGP)
    log_odds = (mean_c - _log1mexp(mean_c)) - (mean_r - _log1mexp(mean_r))
    return -mean_c - orpo_lambda * F.logsigmoid(log_odds)


# --- combining, the auxiliary NLL term, metrics -------------------------------------------------

def combine_losses(
    names: Sequence[str],
    weights: Sequence[float] | None,
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    **kwargs,
) -> torch.Tensor:
    """``Σ_i w_i · L_i`` per pair ``[B]`` for ``dpo.loss: [a, b, …]`` with ``dpo.loss_weights``.

    ``weights=None`` gives every loss weight 1 (as TRL does for a list of losses). Weights are not
    renormalised: ``[0.5, 0.5]`` halves each loss, ``[1, 1]`` sums them. ``kwargs`` go to every
    loss (``beta``, ``label_smoothing``, lengths, ``simpo_gamma``, …); a parameter that none of the
    named losses reads is an error.
    """
    if not names:
        raise ValueError("dpo.loss: name at least one preference loss")
    if weights is None:
        weights = [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(
            f"dpo.loss_weights has {len(weights)} weights but dpo.loss names {len(names)} losses; give one per loss"
        )
    if any(not math.isfinite(float(w)) for w in weights):
        raise ValueError(f"dpo.loss_weights must be finite numbers, got {list(weights)}")
    length_keys = {"chosen_lengths", "rejected_lengths"}
    check_loss_params(names, {k: v for k, v in kwargs.items() if k not in length_keys})
    total = None
    for name, weight in zip(names, weights, strict=True):
        term = float(weight) * LOSSES.get(name)(
            policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, **kwargs
        )
        total = term if total is None else total + term
    return total


def chosen_sft_term(
    chosen_nll_sums: torch.Tensor, chosen_lengths: torch.Tensor, sft_weight: float
) -> torch.Tensor:
    """Auxiliary NLL on the chosen response: ``α · NLL(y_c) / |y_c|`` per pair ``[B]``.

    Pang et al. 2024 ("Iterative Reasoning Preference Optimization", RPO) and Llama 3 (Dubey et
    al. 2024, α = 0.2) add it to DPO so the chosen likelihood does not fall while the margin grows.
    ``chosen_nll_sums`` is ``−π_c`` (the summed token NLL). Departure: RPO divides by prompt+response
    length; we divide by the response tokens only, so α does not depend on the prompt length.
    """
    nll = _as_f32("chosen_nll_sums", chosen_nll_sums)
    lengths = _as_f32("chosen_lengths", chosen_lengths, nll)
    if _host_readable(lengths) and bool((lengths <= 0).any()):
        raise ValueError("chosen_sft_term: every chosen response length must be at least 1 token")
    return sft_weight * nll / lengths


@torch.no_grad()
def preference_metrics(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    *,
    beta: float,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-step metrics as 0-dim tensors on the inputs' device, averaged over the pairs given (average
    across ranks yourself). Tensors, not floats: the training loop sums them on the device and reads them
    once per optimizer step, not once per micro-batch.

    - ``rewards/chosen``, ``rewards/rejected``: implicit rewards ``β·(π − ref)``. Without a reference
      (SimPO/ORPO) the reward is SimPO's ``β·π/|y|`` (or ``β·π`` when no lengths are given).
    - ``rewards/margin``: mean of chosen − rejected reward; ``rewards/accuracy``: fraction of pairs
      whose margin is > 0 (ties count as wrong).
    - ``logps/chosen``, ``logps/rejected``: mean summed policy log-probs.
    - ``kl_to_ref`` (only with a reference): per-token mean log-ratio over chosen and rejected,
      ``Σ(ρ_c + ρ_r) / Σ(|y_c| + |y_r|)`` (per sequence when no lengths are given). This is the k1
      estimator of KL(π‖ref) only for responses sampled from π; on offline pairs it measures how
      far the policy has drifted from the reference on the data, and it can be negative.
    """
    pc, pr = _policy(policy_chosen_logps, policy_rejected_logps)
    has_lengths = chosen_lengths is not None and rejected_lengths is not None
    lc, lr = _lengths("metrics", chosen_lengths, rejected_lengths, pc) if has_lengths else (None, None)
    if ref_chosen_logps is not None and ref_rejected_logps is not None:
        rho_c, rho_r = _log_ratios("metrics", pc, pr, ref_chosen_logps, ref_rejected_logps)
        reward_c, reward_r = beta * rho_c, beta * rho_r
    else:
        rho_c = rho_r = None
        reward_c, reward_r = (beta * pc / lc, beta * pr / lr) if has_lengths else (beta * pc, beta * pr)
    margin = reward_c - reward_r
    metrics = {
        "rewards/chosen": reward_c.mean(),
        "rewards/rejected": reward_r.mean(),
        "rewards/margin": margin.mean(),
        "rewards/accuracy": (margin > 0).float().mean(),
        "logps/chosen": pc.mean(),
        "logps/rejected": pr.mean(),
    }
    if rho_c is not None:
        if has_lengths:
            metrics["kl_to_ref"] = (rho_c.sum() + rho_r.sum()) / (lc.sum() + lr.sum())
        else:
            metrics["kl_to_ref"] = (rho_c + rho_r).mean() / 2
    return metrics
