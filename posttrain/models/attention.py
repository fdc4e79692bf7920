"""Attention for packed rows without a dense mask: the ``varlen`` implementation.

A packed row holds several examples, each with its own position ids (``posttrain.data.packing``). With
``sdpa`` or ``eager``, transformers turns those position ids into a dense block-diagonal causal mask
``[rows, 1, seq, seq]`` (checking on the host whether the row is packed at all), and the attention kernel
then visits every ``seq x seq`` block, masked or not. The ``varlen`` implementation instead hands the
kernel the example boundaries, ``cu_seq_lens`` (cumulative lengths over the flattened batch), so each
example attends only within itself and no mask is built: on CUDA in half precision through torch's own
variable-length Flash Attention (``torch.nn.attention.varlen.varlen_attn``, built into torch, nothing to
install); elsewhere through a reference loop of per-example SDPA calls (correct, not fast: the test
oracle, and what a float32 run gets).

Which calls take which path:

- A forward that carries ``cu_seq_lens_q`` (the packed SFT rows, ``collate_packed``) takes the varlen
  path. :func:`decoder_forward` passes the boundaries and marks the call, so the mask builder skips the
  mask entirely (:func:`varlen_mask`) — no dense mask, no host sync.
- Every other forward (right-padded batches, the 4-D prefix-sharing masks of preference pairs, cached
  left-padded generation) is exactly ``sdpa``: the same mask builder, the same kernel.

``model.attn_implementation: auto`` picks ``varlen`` where the fast kernel exists (a CUDA device, torch
with ``varlen_attn``, bf16 compute) and ``sdpa`` otherwise (:func:`resolve_attn_implementation`).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

VARLEN = "posttrain_varlen"  # the name transformers knows the implementation by
# The keys a batch carries for varlen attention; transformers' own names (``FlashAttentionKwargs``), so a
# batch also feeds its flash_attention_2 implementation unchanged.
SEGMENT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# Set while a forward runs whose segment boundaries travel as keyword arguments (decoder_forward).
_SEGMENTS_IN_KWARGS = contextvars.ContextVar("posttrain_segments_in_kwargs", default=False)


# ----------------------------------------------------------------------------- selection


def flash_varlen_available() -> bool:
    """Whether this torch has the variable-length Flash Attention op and a CUDA device to run it on."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attn_implementation(requested: str, half_precision: bool, kernel_available: bool | None = None) -> str:
    """The attention implementation a model is loaded with: ``sdpa``, ``eager`` or ``varlen``.

    ``auto`` is ``varlen`` when the fast kernel can run — ``kernel_available`` (default:
    :func:`flash_varlen_available`) and ``half_precision`` (bf16 weights or ``train.precision: bf16``;
    Flash Attention has no float32 kernel) — and ``sdpa`` otherwise, i.e. on every CPU machine.
    ``varlen`` asked for explicitly is honoured even without the kernel (the reference loop), with a
    warning, so it can be checked anywhere.
    """
    if requested not in ("auto", "sdpa", "eager", "varlen"):
        raise ValueError(f"unknown attention implementation {requested!r}: auto, sdpa, eager or varlen")
    available = flash_varlen_available() if kernel_available is None else kernel_available
    if requested == "auto":
        return "varlen" if available and half_precision else "sdpa"
    if requested == "varlen" and not (available and half_precision):
        why = "no CUDA device with torch's varlen_attn" if not available else "float32 compute"
        log.warning("attn_implementation varlen: %s, so packed rows run the reference per-example loop (slow)", why)
    return requested


def attention_for(model_config, precision: str) -> str:
    """The implementation a recipe's model loads with: ``model.attn_implementation`` resolved for this
    machine, half precision meaning bf16 weights or ``train.precision: bf16``."""
    half = model_config.dtype == "bfloat16" or precision == "bf16"
    return resolve_attn_implementation(model_config.attn_implementation, half_precision=half)


def transformers_name(implementation: str) -> str:
    """The name to pass ``from_pretrained`` (registering the varlen implementation first)."""
    if implementation != "varlen":
        return implementation
    register_varlen_attention()
    return VARLEN


# ----------------------------------------------------------------------------- segments


def segment_boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seq_lens [segments + 1] int32, longest segment)`` of packed rows ``[rows, seq]``, flattened.

    A segment starts at each row's first token and wherever the position does not grow by exactly one —
    transformers' rule (``masking_utils.find_packed_sequence_indices``), so both paths see the same
    examples. Computed on the host from the collated batch (the packer's position ids are on the CPU
    there), so the training step never waits for the device to learn its boundaries.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [rows, seq], got shape {tuple(position_ids.shape)}")
    rows, width = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    flat_starts = torch.nonzero(starts.reshape(-1)).squeeze(-1)
    cu_seq_lens = torch.cat([flat_starts, torch.tensor([rows * width])]).to(torch.int32)
    longest = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
    return cu_seq_lens, longest


def segment_kwargs(position_ids: torch.Tensor) -> dict:
    """The batch keys (:data:`SEGMENT_KEYS`) that describe packed rows to the varlen path."""
    cu_seq_lens, longest = segment_boundaries(position_ids)
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest,
            "max_length_k": longest}


def attention_kwargs(batch: dict) -> dict:
    """The segment keys present in ``batch`` (empty for a padded batch)."""
    return {key: batch[key] for key in SEGMENT_KEYS if key in batch}


# ----------------------------------------------------------------------------- the decoder call


def decoder_forward(decoder: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, segments: dict | None = None):
    """``decoder(input_ids, attention_mask, position_ids, use_cache=False)``, packed rows through varlen.

    ``segments`` (:func:`segment_kwargs`) reach the attention layers as keyword arguments. On a varlen
    model they also switch the mask builder off for this call: the batch is passed an all-ones padding
    mask (so transformers does not probe the position ids for packing, a host sync) and
    :func:`varlen_mask` returns no mask. Other implementations ignore the keys and build their
    block-diagonal mask from the position ids as before.
    """
    segments = segments or {}
    varlen = bool(segments) and getattr(decoder.config, "_attn_implementation", None) == VARLEN
    if varlen and attention_mask is not None:
        raise ValueError("packed rows carry no attention mask: their segments are in cu_seq_lens")
    token = _SEGMENTS_IN_KWARGS.set(True) if varlen else None
    try:
        if varlen:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        return decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False, **segments)
    finally:
        if token is not None:
            _SEGMENTS_IN_KWARGS.reset(token)


# ----------------------------------------------------------------------------- kernels


def reference_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               cu_seq_lens: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal attention within each segment, one SDPA call per segment: ``[T, Hq, D]`` → ``[T, Hq, D]``.

    ``key``/``value`` may have fewer heads (grouped-query attention); each serves ``Hq / Hkv`` query heads.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.empty_like(query)
    bounds = cu_seq_lens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [H, len, D]
        out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)
    return out


_VARLEN_PARAMETERS: frozenset[str] | None = None


def _varlen_parameters() -> frozenset[str]:
    """The keyword arguments this torch's ``varlen_attn`` takes, read once (at model load, through
    :func:`register_varlen_attention`): a plain global afterwards, which a compiled block reads as a constant
    instead of tracing ``inspect``."""
    global _VARLEN_PARAMETERS
    if _VARLEN_PARAMETERS is None:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_PARAMETERS = frozenset(inspect.signature(varlen_attn).parameters)
    return _VARLEN_PARAMETERS


def flash_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                           max_length: int, scale: float | None) -> torch.Tensor:
    """torch's variable-length Flash Attention, causal within each segment: ``[T, Hq, D]`` → ``[T, Hq, D]``.

    The op's arguments changed across torch releases (2.9–2.10: ``is_causal``; 2.12 on: ``window_size``
    with ``(-1, 0)`` for causal, ``scale``, ``enable_gqa``), so the call is built from its signature;
    without ``enable_gqa`` the key/value heads are repeated for grouped-query attention.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_parameters()
    options: dict = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if scale is not None:
        if "scale" in params:
            options["scale"] = scale
        elif abs(scale - query.shape[-1] ** -0.5) > 1e-12:
            raise NotImplementedError("this torch's varlen_attn has no scale argument; the model scales attention "
                                      f"by {scale}, not 1/sqrt(head_dim)")
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    cu_seq_lens = cu_seq_lens.to(device=query.device, dtype=torch.int32)
    return varlen_attn(query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length, **options)


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype attention runs in on ``device``: autocast's when it is on there, else ``dtype`` (the
    tensors', or the possibly FSDP-cast weights')."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


# ----------------------------------------------------------------------------- the transformers hooks


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs):
    """transformers' attention-function interface (``query`` ``[B, Hq, S, D]``, output ``[B, S, Hq, D]``).

    With ``cu_seq_lens_q`` in ``kwargs``: the rows are flattened to ``[B·S, H, D]`` and attended segment
    by segment (Flash on CUDA in half precision, the reference loop otherwise). Without: transformers'
    own SDPA function, unchanged.
    """
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout and module.training:
        raise NotImplementedError("varlen attention has no dropout; set the model's attention_dropout to 0")
    batch, heads, seq, head_dim = query.shape
    dtype = compute_dtype(query.device, query.dtype)
    flat = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], head_dim).to(dtype) for t in (query, key, value)]
    if query.is_cuda and dtype in (torch.float16, torch.bfloat16):
        out = flash_varlen_attention(*flat, cu_seq_lens, int(kwargs["max_length_q"]), scaling)
    else:
        out = reference_varlen_attention(*flat, cu_seq_lens, scaling)
    return out.reshape(batch, seq, heads, head_dim), None


def varlen_mask(*args, **kwargs):
    """The mask builder for the varlen implementation: none when the segments travel as keyword arguments
    (:func:`decoder_forward`), transformers' SDPA mask otherwise (padded batches, generation)."""
    if _SEGMENTS_IN_KWARGS.get():
        return None
    from transformers import masking_utils

    return masking_utils.sdpa_mask(*args, **kwargs)


@functools.cache
def register_varlen_attention() -> str:
    """Register :data:`VARLEN` with transformers' attention and mask interfaces (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, varlen_mask)
    if flash_varlen_available():
        _varlen_parameters()  # read outside any compiled region
    return VARLEN
