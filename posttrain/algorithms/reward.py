"""Bradley–Terry reward-model loss: a scalar score per response, trained on preference pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _scores(name: str, values: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    if values.dim() != 1:
        raise ValueError(
            f"{name} must be a [batch] tensor of scalar rewards, got shape {tuple(values.shape)}"
        )
    if like is not None and values.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(values.shape)} but chosen_rewards has {tuple(like.shape)}")
    return values.float()


def bradley_terry_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-pair loss ``[B]``: ``L = −log σ(r_c − r_r − m)``.

    Bradley & Terry 1952 preference model, as the reward-model objective of Stiennon et al. 2020
    ("Learning to summarize from human feedback") and Ouyang et al. 2022. ``margin`` ``m`` ``[B]`` is
    Llama 2's variant (Touvron et al. 2023, eq. 2): a larger required gap for pairs annotators rated
    as clearly different (e.g. from the score difference); ``None`` means ``m = 0``.
    """
    chosen = _scores("chosen_rewards", chosen_rewards)
    rejected = _scores("rejected_rewards", rejected_rewards, chosen)
    gap = chosen - rejected
    if margin is not None:
        gap = gap - _scores("margin", torch.as_tensor(margin, device=chosen.device), chosen)
    return -F.logsigmoid(gap)


@torch.no_grad()
def pairwise_accuracy(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> float:
    """Fraction of pairs whose chosen response scores strictly higher (ties count as wrong)."""
    chosen = _scores("chosen_rewards", chosen_rewards)
    rejected = _scores("rejected_rewards", rejected_rewards, chosen)
    if chosen.numel() == 0:
        raise ValueError("pairwise_accuracy needs at least one pair")
    return float((chosen > rejected).float().mean())
