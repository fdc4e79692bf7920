"""Supervised fine-tuning loss: next-token NLL, summed; the loop divides by the step's global token count."""

from __future__ import annotations

import torch


def sft_loss(token_logprobs: torch.Tensor) -> torch.Tensor:
    """``L = −Σ_t log p(y_t | y_<t)`` over this micro-batch's loss tokens (scalar, float32).

    ``token_logprobs`` holds the log-probs of the loss-bearing tokens only (any shape; prompt and
    padding already dropped, e.g. by ``posttrain.models.logprobs``). The *sum* is returned: the training
    loop divides every micro-batch's sum by the number of loss tokens in the whole optimizer step (all
    micro-batches, all ranks; ``StepBatch.normalizer``). Dividing each micro-batch by its own token
    count would weight a token in a short micro-batch more than one in a long one, so 1×8 accumulation
    would not equal 8×1 and ranks with different lengths would disagree; with one global count, the
    summed micro-batch losses (and gradients across ranks) are exactly the full-batch token mean.
    """
    return -token_logprobs.float().sum()


def token_mean(loss_sum: torch.Tensor, num_loss_tokens: int | float) -> torch.Tensor:
    """``loss_sum / N`` with ``N`` the step's global loss-token count; an empty step is an error."""
    count = float(num_loss_tokens)
    if not count > 0:
        raise ValueError(
            f"num_loss_tokens must be positive, got {num_loss_tokens}; a step with no loss-bearing tokens "
            "means every label was masked (check the loss mask)"
        )
    return loss_sum / count
