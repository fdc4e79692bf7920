"""Supervised fine-tuning loss: next-token NLL averaged over the loss-bearing tokens."""

from __future__ import annotations

import torch


def sft_loss(token_logprobs: torch.Tensor, num_loss_tokens: int | float | torch.Tensor) -> torch.Tensor:
    """``L = −Σ_t log p(y_t | y_<t) / N`` over this micro-batch's loss tokens (scalar).

    ``token_logprobs`` holds the log-probs of the loss-bearing tokens only (any shape; prompt and
    padding already dropped, e.g. by ``posttrain.models.logprobs``). ``N`` is the number of loss tokens
    in the *whole optimizer step* — all micro-batches of gradient accumulation, on all ranks —
    counted before the step and passed in. Dividing each micro-batch by its own token count would
    weight a token in a short micro-batch more than one in a long one, so 1×8 accumulation would
    not equal 8×1 and ranks with different lengths would disagree. With a global ``N``, summing the
    micro-batch losses (and gradients across ranks) gives exactly the full-batch token mean.
    """
    count = float(num_loss_tokens)
    if not count > 0:
        raise ValueError(
            f"sft_loss: num_loss_tokens must be positive, got {num_loss_tokens}; "
            "a step with no loss-bearing tokens means every label was masked (check the loss mask)"
        )
    return -token_logprobs.float().sum() / count
