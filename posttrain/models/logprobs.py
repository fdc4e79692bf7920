"""Per-token log-probabilities through the output head, in chunks, only where the loss needs them.

A ``[batch, seq, vocab]`` float32 logits tensor is the largest activation of a small-model training
step (for a 128k vocabulary and 8k tokens it is 4 GiB). We never build it: the final hidden states
at loss-bearing positions are gathered first (``[N, hidden]``), then pushed through the head
``chunk_size`` rows at a time. Each chunk runs under activation checkpointing, so the backward pass
recomputes its logits instead of keeping them: peak extra memory is one ``[chunk, vocab]`` block.
When all ``N x vocab`` float32 logits fit in ``KEEP_LOGITS_BYTES`` (small vocabularies, few loss
tokens) they are kept instead: the recomputation would cost a head matmul and buy almost no memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from posttrain.models.attention import decoder_forward

IGNORE_INDEX = -100
# Below this many bytes of float32 logits, keep them for backward rather than recompute them.
KEEP_LOGITS_BYTES = 64 * 2**20


# The batch keys of the loss positions (``loss_positions``), as the preference pairs carry them too.
POSITION_KEYS = ("gather_index", "targets", "sequence_index")


def loss_positions(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The hidden states that predict a loss-bearing label, as flat indices into ``hidden.reshape(-1, H)``.

    ``hidden[:, t]`` predicts ``labels[:, t + 1]``; positions whose next label is ``IGNORE_INDEX`` are
    dropped. Returns ``gather_index`` (``row · seq + t``), ``targets`` (``labels[row, t + 1]``) and
    ``sequence_index`` (``row``, for per-sequence sums), in row-major order. Collate functions call it on
    the CPU labels: on a device, finding the positions makes the host wait for the device to count them (a
    sync in every forward); the forward then only gathers, with ``index_select``.
    """
    shifted = labels[:, 1:]
    keep = shifted != IGNORE_INDEX
    rows, columns = keep.nonzero(as_tuple=True)
    return {"gather_index": rows * labels.shape[1] + columns, "targets": shifted[keep], "sequence_index": rows}


def batch_positions(batch: dict) -> dict[str, torch.Tensor] | None:
    """The loss positions a collate function put in ``batch`` (:data:`POSITION_KEYS`), or None."""
    return {key: batch[key] for key in POSITION_KEYS} if POSITION_KEYS[0] in batch else None


def _chunk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight).float()
    if temperature != 1.0:  # skipped at 1 so the default numbers stay bit-identical
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logsumexp = torch.logsumexp(logits, dim=-1)
    if not entropy:
        return picked - logsumexp
    with torch.no_grad():  # a metric: H = logsumexp(z) - sum_i p_i z_i, no gradient, no extra backward
        token_entropy = logsumexp - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return picked - logsumexp, token_entropy


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs (got {temperature})")


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 1024,
    keep_logits_bytes: int = KEEP_LOGITS_BYTES,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(hidden @ weight.T / temperature)[i, targets[i]]`` for each row, in float32, chunk by chunk.

    Shapes: hidden ``[N, H]``, weight ``[V, H]``, targets ``[N]`` → ``[N]``. Under autograd each chunk
    is checkpointed (its logits recomputed in backward) unless ``N * V * 4 <= keep_logits_bytes``.
    ``temperature`` divides the float32 logits before the softmax, as the sampler does
    (``posttrain.generate.engine``), so RL ratios compare the same distribution; at 1.0 (the default) the
    division is skipped. ``return_entropy``: also return each row's entropy of that distribution
    (``[N]``, detached: a metric computed from the logits already in hand).
    """
    _check_temperature(temperature)
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + 0.0 * weight.sum()
        return (empty, empty.detach()) if return_entropy else empty
    pieces, entropies = [], []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    recompute = needs_grad and hidden.shape[0] * weight.shape[0] * 4 > keep_logits_bytes
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if recompute:
            out = checkpoint(_chunk_logprobs, h, weight, t, temperature, return_entropy, use_reentrant=False)
        else:
            out = _chunk_logprobs(h, weight, t, temperature, return_entropy)
        if return_entropy:
            out, token_entropy = out
            entropies.append(token_entropy)
        pieces.append(out)
    return (torch.cat(pieces), torch.cat(entropies)) if return_entropy else torch.cat(pieces)


def chunked_summed_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           chunk_size: int = 1024) -> torch.Tensor:
    """``Σ_i log softmax(hidden_i · weightᵀ)[targets_i]`` through :func:`chunked_token_logprobs`: the SFT loss's
    head (``TokenLogprobModel(summed=True)``), and the reference Liger's fused head is measured against."""
    return chunked_token_logprobs(hidden, weight, targets, chunk_size).sum()


def naive_token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference implementation over full logits ``[B, T, V]``; used by tests only."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    shifted = labels[:, 1:]
    keep = shifted != IGNORE_INDEX
    return logprobs[keep].gather(-1, shifted[keep].unsqueeze(-1)).squeeze(-1)


def per_sequence_sum(values: torch.Tensor, rows: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Sum token values into their batch rows: ``[N] → [batch_size]``."""
    out = torch.zeros(batch_size, dtype=values.dtype, device=values.device)
    return out.index_add(0, rows, values)


def model_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    segments: dict | None = None,
    positions: dict | None = None,
    head_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Run an HF causal LM's decoder and return ``(token_logprobs [N], rows [N])`` at loss positions
    (``(token_logprobs, rows, entropy [N])`` with ``return_entropy``); ``temperature`` as in
    ``chunked_token_logprobs``. ``segments``: packed rows' boundaries for varlen attention
    (``posttrain.models.attention.segment_kwargs``; ignored by the other implementations). ``positions``:
    the loss positions the collate function found on the host (:func:`loss_positions`); without them they
    are found from ``labels`` here, on the device. ``head_fn(hidden [N, H], weight [V, H], targets [N])``
    replaces the chunked head and its value is returned in place of the token log-probs
    (``TokenLogprobModel``'s summed head).

    Works for architectures whose logits are ``lm_head(final_hidden)`` without scaling or soft-capping
    (Llama, Mistral, Qwen2/3); others raise rather than return subtly wrong numbers.
    """
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale"):
        if config is not None and getattr(config, attr, None) not in (None, 1.0):
            raise NotImplementedError(f"chunked log-probs do not support {attr} ({type(model).__name__})")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    outputs = decoder_forward(decoder, input_ids, attention_mask, position_ids, segments)
    positions = positions or loss_positions(labels)
    states = outputs.last_hidden_state
    hidden = states.reshape(-1, states.shape[-1]).index_select(0, positions["gather_index"])
    targets, rows = positions["targets"], positions["sequence_index"]
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("chunked log-probs assume an output head without bias")
    if head_fn is not None:
        return head_fn(hidden, head.weight, targets), rows
    values = chunked_token_logprobs(hidden, head.weight, targets, chunk_size, temperature=temperature,
                                    return_entropy=return_entropy)
    if return_entropy:
        return values[0], rows, values[1]
    return values, rows


@torch.no_grad()
def mean_label_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                        attention_mask: torch.Tensor | None = None) -> list[float]:
    """Per row, the mean log-prob of its loss-bearing labels under ``model`` (``nan`` for a row with none):
    ``(1/|y|) · Σ_t log p(y_t | x, y_<t)``. For scoring (judges, IFD), not training: no gradient."""
    device = next(model.parameters()).device
    mask = None if attention_mask is None else attention_mask.to(device)
    logprobs, rows = model_token_logprobs(model, input_ids.to(device), labels.to(device), mask)
    batch = input_ids.shape[0]
    sums = torch.zeros(batch, dtype=torch.float64).index_add(0, rows.cpu(), logprobs.double().cpu())
    counts = torch.bincount(rows.cpu(), minlength=batch).double()
    return (sums / counts).tolist()  # 0/0 = nan: the row had no label to score


class TokenLogprobModel(torch.nn.Module):
    """Wraps an HF causal LM so that one ``forward`` returns log-probs at loss positions.

    Under FSDP2 this wrapper is the root module: its pre-forward hook gathers the embedding, final
    norm and output head, which then stay gathered through backward, so the chunked head can use the
    head weight directly. Export and generation use ``.lm``, the plain HF model.

    ``forward(..., summed=True)`` returns ``(Σ token log-probs, rows)``: a scalar, all the SFT loss needs,
    computed by ``summed_head(hidden [N, H], weight [V, H], targets [N])`` when one is given (Liger's fused
    linear cross-entropy, ``posttrain.models.liger``), else by the chunked head. It runs inside this forward
    so that under FSDP2 the head weight is the gathered one.
    """

    def __init__(self, lm: torch.nn.Module, chunk_size: int = 1024,
                 summed_head: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size
        self.summed_head = summed_head

    def _chunked_sum(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return chunked_summed_logprob(hidden, weight, targets, self.chunk_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        return_entropy: bool = False,
        segments: dict | None = None,
        positions: dict | None = None,
        summed: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        if summed and (temperature != 1.0 or return_entropy):
            raise ValueError("summed=True is the SFT loss's sum at temperature 1, without entropies")
        return model_token_logprobs(
            self.lm, input_ids, labels, attention_mask, position_ids, chunk_size=self.chunk_size,
            temperature=temperature, return_entropy=return_entropy, segments=segments, positions=positions,
            head_fn=(self.summed_head or self._chunked_sum) if summed else None,
        )
