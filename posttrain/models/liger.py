"""Liger's Triton kernels behind ``model.liger`` (``pip install 'posttrain[liger]'``; CUDA only; docs/liger.md).

Two parts, both optional and both GPU-only (Liger's kernels are Triton kernels: on a CPU tensor they fail
with "0 active drivers", so ``check_liger`` refuses a run without a CUDA device before any weight loads):

* ``apply_kernels(lm)`` swaps the RMSNorms, the SwiGLU product ``silu(gate(x)) * up(x)`` and RoPE of **one
  loaded model** for Liger's fused kernels (``liger_kernel.transformers.functional``). Each module's
  ``forward`` is replaced on the instance, as ``posttrain.models.blocks.recompute_gated_mlp`` does; the
  transformers classes are not touched. Liger's own ``apply_liger_kernel_to_llama(model=...)`` is not used:
  even with a model it rebinds ``modeling_llama.LlamaRMSNorm``, ``LlamaMLP`` and ``apply_rotary_pos_emb``
  for the whole process, so a reference model loaded afterwards would silently be built from Liger's
  modules.
  RoPE cannot be swapped per instance: HF attention calls the module-level ``apply_rotary_pos_emb``. That
  one function is replaced, once per modeling module, by a dispatcher that calls Liger's kernel only while
  a patched model's attention runs (a context variable its wrapped ``forward`` sets) and HF's original
  otherwise, so every other model in the process computes exactly what it did before.
* ``liger_summed_logprob(hidden, weight, targets)``: ``Σ_i log p(targets_i)`` through Liger's fused linear
  cross-entropy, the SFT/pretrain loss head when ``model.liger`` is on (``TokenLogprobModel(summed_head=…)``;
  DPO, RM and GRPO keep posttrain's chunked head, see ``liger_summed_logprob``).

``compare_heads`` measures that head against ``posttrain.models.logprobs.chunked_token_logprobs`` (loss,
gradients, peak memory) on one device, for the GPU test and the benchmark.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType

import torch

from posttrain.models.blocks import decoder_layers
from posttrain.models.load import model_source

MISSING = "model.liger needs the liger-kernel package: pip install 'posttrain[liger]'"
NO_CUDA = "model.liger: Liger's kernels are Triton GPU kernels and need a CUDA device"
# model_type → the transformers module whose RMSNorm / MLP / apply_rotary_pos_emb the kernels replace. All four
# use HF's Llama RMSNorm ("llama" casting: normalise in fp32, cast back, scale), a SiLU-gated MLP and
# rotate-half RoPE, which is what Liger's kernels compute.
SUPPORTED = {
    "llama": "transformers.models.llama.modeling_llama",
    "mistral": "transformers.models.mistral.modeling_mistral",
    "qwen2": "transformers.models.qwen2.modeling_qwen2",
    "qwen3": "transformers.models.qwen3.modeling_qwen3",
}
GATED_ACTIVATIONS = ("silu", "swish")


class LigerSetupError(RuntimeError):
    """``model.liger`` cannot run as configured; the one-line message says what to do."""


def _require_supported(model_type: str) -> None:
    if model_type not in SUPPORTED:
        raise LigerSetupError(f"model.liger supports model types {', '.join(SUPPORTED)}, not {model_type!r}: "
                              "set model.liger=false for this model")


def check_liger(path: str, trust_remote_code: bool, recompute_mlp: bool, device: torch.device) -> None:
    """Refuse ``model.liger`` at run setup (before any weight loads) where it cannot work.

    Checked in this order: an architecture the kernels do not cover (``model_type`` of ``path``'s config),
    ``train.recompute_mlp`` (it would replace Liger's SwiGLU forward again), the package missing, no CUDA
    device.
    """
    from transformers import AutoConfig

    with model_source(path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    _require_supported(config.model_type)
    if recompute_mlp:
        raise LigerSetupError("model.liger and train.recompute_mlp both replace each gated MLP's forward: set one "
                              "of them (Liger's SwiGLU kernel already recomputes silu(gate) in backward)")
    try:
        importlib.import_module("liger_kernel.transformers.functional")
    except ImportError:
        raise LigerSetupError(MISSING) from None
    if torch.device(device).type != "cuda":
        raise LigerSetupError(NO_CUDA)


@dataclass(frozen=True)
class Kernels:
    """The three functions ``apply_kernels`` routes through (Liger's by default; a test may pass others).

    ``rms_norm(x, weight, eps)``, ``swiglu(gate, up) = silu(gate) * up``, ``rope(q, k, cos, sin, unsqueeze_dim)``
    with HF's ``apply_rotary_pos_emb`` shapes (q ``[B, heads, T, D]``, cos/sin ``[B, T, D]``).
    """

    rms_norm: Callable
    swiglu: Callable
    rope: Callable

    @classmethod
    def liger(cls) -> Kernels:
        from liger_kernel.transformers.functional import liger_rms_norm, liger_rope, liger_swiglu

        return cls(
            # casting_mode="llama" and in_place=True: what Liger's own Llama/Mistral/Qwen patches use.
            rms_norm=lambda x, weight, eps: liger_rms_norm(x, weight, eps, offset=0.0, casting_mode="llama",
                                                           in_place=True),
            swiglu=liger_swiglu,
            rope=lambda q, k, cos, sin, unsqueeze_dim=1: liger_rope(q, k, cos, sin, None, unsqueeze_dim),
        )


# Set while a patched model's attention runs: the RoPE dispatcher then calls that model's kernel.
_ROPE_KERNEL: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("posttrain_liger_rope", default=None)


def _install_rope_dispatcher(modeling) -> None:
    """Replace ``modeling.apply_rotary_pos_emb`` (once) by: the active kernel if any, else HF's original."""
    original = modeling.apply_rotary_pos_emb
    if getattr(original, "posttrain_hf_original", None) is not None:
        return

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        kernel = _ROPE_KERNEL.get()
        if kernel is None:
            return original(q, k, cos, sin, unsqueeze_dim)
        return kernel(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.posttrain_hf_original = original
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb


def _rms_norm_forward(kernel: Callable):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return kernel(hidden_states, self.weight, self.variance_epsilon)

    return forward


def _swiglu_forward(kernel: Callable):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernel(self.gate_proj(x), self.up_proj(x)))

    return forward


def _rope_attention_forward(kernel: Callable):
    # The class's forward, called with the kernel active: bound to the instance (no captured module), so a
    # deep copy of the model calls its own attention.
    def forward(self, *args, **kwargs):
        token = _ROPE_KERNEL.set(kernel)
        try:
            return type(self).forward(self, *args, **kwargs)
        finally:
            _ROPE_KERNEL.reset(token)

    return forward


def apply_kernels(lm: torch.nn.Module, kernels: Kernels | None = None) -> str:
    """Route ``lm``'s RMSNorms, gated MLPs and RoPE through ``kernels`` (Liger's by default); returns a summary.

    ``lm``: an HF causal LM (or sequence classifier) of a ``SUPPORTED`` type, before peft wraps it (LoRA's
    adapted projections are then called by the new MLP forward as before). Only this instance changes (see
    the module docstring for RoPE's dispatcher). Forward and backward compute the same function; the
    kernels fuse the elementwise work and keep less for backward (RMSNorm its inverse RMS, SwiGLU only
    ``gate`` and ``up``).
    """
    model_type = lm.config.model_type
    _require_supported(model_type)
    if getattr(lm.config, "hidden_act", "silu") not in GATED_ACTIVATIONS:
        raise LigerSetupError(f"model.liger: Liger's SwiGLU kernel is silu-gated; this model's hidden_act is "
                              f"{lm.config.hidden_act!r}: set model.liger=false")
    kernels = kernels or Kernels.liger()
    modeling = importlib.import_module(SUPPORTED[model_type])
    _install_rope_dispatcher(modeling)
    norms = mlps = attentions = 0
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
    for module in decoder.modules():
        if type(module).__module__ == modeling.__name__ and type(module).__name__.endswith("RMSNorm"):
            module.forward = MethodType(_rms_norm_forward(kernels.rms_norm), module)
            norms += 1
    for layer in decoder_layers(lm):
        layer.mlp.forward = MethodType(_swiglu_forward(kernels.swiglu), layer.mlp)
        layer.self_attn.forward = MethodType(_rope_attention_forward(kernels.rope), layer.self_attn)
        mlps, attentions = mlps + 1, attentions + 1
    return f"Liger kernels: {norms} RMSNorm, {mlps} SwiGLU, RoPE in {attentions} attention blocks"


def liger_summed_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``Σ_i log softmax(hidden_i · weightᵀ)[targets_i]`` (a float32 scalar) through Liger's fused linear
    cross-entropy: ``−FLCE(hidden, weight, targets, reduction="sum")``.

    Shapes: hidden ``[N, H]``, weight ``[V, H]`` (no bias), targets ``[N]`` (no ignored entries: the caller
    selected the loss positions). The same number as ``chunked_token_logprobs(...).sum()``; the kernel never
    holds more than a chunk of logits either, but computes the gradients of ``hidden`` and ``weight`` during
    the forward (kept until backward scales them by the upstream gradient), so no recomputation happens in
    backward. The weight gradient accumulates in the weight's dtype (Liger's ``accum_dtype=None``), as
    autograd does over posttrain's chunks.

    Used only for the SFT/pretrain loss (a sum). DPO, RM and GRPO need per-token or per-sequence log-probs
    and keep posttrain's chunked head. Liger's ``reduction="none"`` backward is exact only from 0.8.2 (it
    defers the gradient to backward and folds the per-token upstream gradient in before summing over
    tokens); up to 0.8.1 the gradients were computed in the forward as for a summed loss and backward
    multiplied them by the upstream gradient as if it were one scalar, which is wrong per token.
    """
    if hidden.shape[0] == 0:  # no loss token in this micro-batch: a zero that still reaches the weight
        return hidden.new_zeros((), dtype=torch.float32) + 0.0 * weight.sum()
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return -liger_fused_linear_cross_entropy(hidden, weight, targets, reduction="sum").float()


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30))


def _run_head(head: Callable, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> dict:
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    cuda = hidden.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(hidden.device)
        torch.cuda.reset_peak_memory_stats(hidden.device)
        base = torch.cuda.memory_allocated(hidden.device)
    start = time.perf_counter()
    total = head(hidden, weight, targets)
    total.backward()
    if cuda:
        torch.cuda.synchronize(hidden.device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(hidden.device) - base if cuda else None
    return {"loss": -total.detach(), "grad_hidden": hidden.grad, "grad_weight": weight.grad, "seconds": seconds,
            "peak_bytes": peak}


def compare_heads(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = 1024,
                  fused_head: Callable | None = None) -> dict[str, float | None]:
    """Summed NLL and its gradients through posttrain's chunked head and through Liger's fused head, side by side.

    ``hidden [N, H]``, ``weight [V, H]``, ``targets [N]`` on one device (CUDA for Liger); each head runs forward
    + backward once on fresh leaf copies. Returns ``{"loss_chunked", "loss_liger", "loss_rel_diff",
    "grad_hidden_rel_diff", "grad_weight_rel_diff"`` (``‖liger − chunked‖ / ‖chunked‖``), ``"seconds_chunked",
    "seconds_liger"`` (one pass each, wall clock: warm up before timing), ``"peak_bytes_chunked",
    "peak_bytes_liger"``} (CUDA peak allocation above what was allocated before the pass; None off CUDA).
    ``fused_head`` replaces Liger's head (default ``liger_summed_logprob``).
    """
    from posttrain.models.logprobs import chunked_summed_logprob

    reference = _run_head(functools.partial(chunked_summed_logprob, chunk_size=chunk_size), hidden, weight, targets)
    fused = _run_head(fused_head or liger_summed_logprob, hidden, weight, targets)
    return {
        "loss_chunked": float(reference["loss"]),
        "loss_liger": float(fused["loss"]),
        "loss_rel_diff": _relative(fused["loss"], reference["loss"]),
        "grad_hidden_rel_diff": _relative(fused["grad_hidden"], reference["grad_hidden"]),
        "grad_weight_rel_diff": _relative(fused["grad_weight"], reference["grad_weight"]),
        "seconds_chunked": reference["seconds"],
        "seconds_liger": fused["seconds"],
        "peak_bytes_chunked": reference["peak_bytes"],
        "peak_bytes_liger": fused["peak_bytes"],
    }
