"""Token-choice math for the sampler: pure functions on logits, one row per sequence.

Each function takes ``logits`` of shape ``(batch, vocab)`` and returns a tensor of the same shape
(filters), ``(batch,)`` token ids (choosers) or ``(batch,)`` log-probs (``token_logprobs``). Rows never interact, which is what makes a prompt's
samples the same whether it is generated alone or inside a batch.
"""

from __future__ import annotations

import hashlib

import torch


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Scale logits: ``p_i ∝ exp(z_i / T)``. ``T < 1`` sharpens, ``T > 1`` flattens; ``T > 0`` required."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling (got {temperature}); use 0 for greedy")
    return logits / temperature


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits per row, set the rest to ``-inf`` (Fan et al. 2018, top-k sampling).

    ``k <= 0`` or ``k >= vocab`` keeps everything. Ties at the k-th value are all kept.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter (Holtzman et al. 2020): keep the smallest set of tokens whose probability mass
    reaches ``p``, always including the most likely token; the rest become ``-inf``.

    A token is kept when the mass of the tokens strictly more likely than it is below ``p``.
    ``p >= 1`` keeps everything.
    """
    if p >= 1.0:
        return logits
    if p <= 0.0:
        raise ValueError(f"top_p must be in (0, 1] (got {p})")
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``argmax_i z_i`` per row; ties go to the lowest token id, so the choice is deterministic."""
    return torch.argmax(logits, dim=-1)


def sample_inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row by inverting the CDF of ``softmax(logits)`` at ``uniforms`` (shape ``(batch,)``,
    values in [0, 1)). Given the same uniform, a row picks the same token whatever else is in the batch.

    Computed in float64 so that tiny float32 noise between batch shapes cannot move a draw across a bin edge
    except when the uniform falls within ~1e-7 of it.
    """
    probs = torch.softmax(logits.double(), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    target = (uniforms.to(cdf.device, torch.float64) * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Never land on a token that the filters removed (zero-probability tail after rounding).
    return torch.minimum(index, (probs > 0).long().cumsum(-1).argmax(-1))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[row, tokens[row]]`` in float32: logits ``(batch, vocab)``, tokens ``(batch,)`` →
    ``(batch,)``. Written as ``z_token - logsumexp(z)``, the expression the training forward uses
    (``posttrain.models.logprobs``), so the two agree to float32 rounding on the same logits."""
    logits = logits.float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one sequence, derived from the run seed and the sequence's position in the request,
    so that a request gives the same samples however it is split into batches."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
