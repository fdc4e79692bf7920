"""Memory per GPU of a training step under ZeRO-3 / FSDP2 full sharding.

What is counted (bytes per parameter, before dividing by the N GPUs that shard them):

* ``bf16`` (torch FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, AdamW):
  fp32 master parameter 4 + fp32 gradient 4 + Adam m 4 + Adam v 4 = **16 B**, plus **2 B** for the bf16 copy
  of the shard that FSDP casts before each all-gather (in FSDP2 it is transient; counting it keeps the total an
  upper bound and equals DeepSpeed's ZeRO-3 accounting of 18 B/param). On top, the **gathered largest unit**:
  unsharded bf16 parameters + bf16 gradients of one block (4 B/param of that unit), only when N > 1.
* ``fp32`` (no mixed precision): parameter 4 + gradient 4 + Adam m, v 8 = 16 B; gathered unit 8 B/param.

Offload (per node, gpus_per_node GPUs): ``optimizer`` moves the 16 B of fp32 state (master, grads, m, v) to
host memory and leaves the 2 B bf16 shard on the GPU; ``params`` moves all 18 B and leaves only the gathered
unit. Sources: Rajbhandari et al. 2020 (ZeRO, §3 "16Ψ" model states for mixed-precision Adam); DeepSpeed's
``estimate_zero3_model_states_mem_needs`` (same 18 B/param + 4 B × largest layer); torch FSDP2 docs.

Activations per layer follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), eq. 1: s·b·h·(34 + 5·a·s/h) bytes in 16-bit for a GPT block. That 34 counts,
in bytes per s·b·h: two LayerNorm inputs 4; attention 11 (QKV input 2, Q and K 4, V 2, output-projection input 2,
dropout mask 1); MLP 19 (input 2, GeLU input 8, GeLU output 8, dropout mask 1). For a Llama block (no dropout,
RMSNorm, GQA, SwiGLU) the same bookkeeping gives, with e bytes per element (2 for bf16, 4 for fp32):

    e · (2 + 3 + 2·kv/h + 1 + 4·i/h)   per s·b·h
         │   │    │       │   └ SwiGLU: gate, up, silu(gate), gate·up, each i wide (3 matrices, not 2)
         │   │    │       └ MLP input (the norm output)
         │   │    └ K and V, each kv_heads·head_dim wide (GQA makes them smaller than Q)
         │   └ QKV input, Q, attention output (the output projection's input)
         └ the two norm inputs

which is 41 for Llama-3 8B in bf16 (kv/h = 1/4, i/h = 3.5). The 5·a·s/h term is the s² attention matrix
(softmax output 2, dropout mask 1, dropout output 2): flash / SDPA attention never stores it (``flash=True``, the
default), selective recompute drops it, and without either it is added. Full recompute keeps the block input
e·s·b·h per layer plus one layer's working set while that layer is recomputed in backward.

``layers="hf"`` counts what HF transformers' ``LlamaDecoderLayer`` (the model posttrain trains) keeps on top of
that minimal bookkeeping, read from its code: each ``LlamaRMSNorm`` upcasts to fp32 and keeps that fp32 input
and the normalised tensor before the weight multiply (4 + e per norm instead of e); the attention output is kept
twice (SDPA saves its output in head layout, ``o_proj`` its contiguous ``[s, b, h]`` copy: + e); and when an
attention mask is passed (padded batches), ``repeat_kv`` expands K and V to all heads before SDPA, so they are
stored at full width (``expanded_kv=True``). Both modes miss the allocator's own overhead and short-lived
temporaries; tests/plan/test_measured.py compares them with measured runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from posttrain.algorithms.registry import Registry
from posttrain.plan.shapes import ModelShape

GIB = 2**30
ELEMENT_BYTES = {"bf16": 2, "fp32": 4}
STATE_BYTES = {"bf16": 16, "fp32": 16}  # sharded fp32 state per param (see the module docstring)
SHARD_COPY_BYTES = {"bf16": 2, "fp32": 0}  # the bf16 copy of the shard cast before all-gather
GATHERED_BYTES = {"bf16": 4, "fp32": 8}  # unsharded params + grads of the gathered unit


@dataclass(frozen=True)
class ModelStates:
    sharded_gpu: float  # bytes per GPU, persistent
    gathered_gpu: float  # bytes per GPU, the largest unit while it is gathered
    host_per_node: float  # bytes of host memory per node (offload)


def model_states(params: int, largest_unit: int, gpus: int, gpus_per_node: int, precision: str = "bf16",
                 offload: str = "none") -> ModelStates:
    """Parameters, gradients and AdamW state per GPU under full sharding over ``gpus`` (module docstring)."""
    state = STATE_BYTES[precision] * params / gpus
    copy = SHARD_COPY_BYTES[precision] * params / gpus
    gathered = GATHERED_BYTES[precision] * largest_unit if gpus > 1 or offload == "params" else 0.0
    per_node = gpus_per_node if gpus >= gpus_per_node else gpus
    if offload == "none":
        return ModelStates(state + copy, gathered, 0.0)
    if offload == "optimizer":
        return ModelStates(copy, gathered, state * per_node)
    if offload == "params":
        return ModelStates(0.0, gathered, (state + copy) * per_node)
    raise ValueError(f"offload {offload!r}: expected none, optimizer or params")


def layer_activation_coefficient(shape: ModelShape, precision: str = "bf16", layers: str = "minimal",
                                 expanded_kv: bool = False) -> float:
    """Bytes per s·b·h one Llama block keeps for backward without recompute, s² terms excluded (docstring)."""
    e = ELEMENT_BYTES[precision]
    kv = 1.0 if expanded_kv else shape.kv_fraction
    mlp = 4 * shape.intermediate_size / shape.hidden_size
    if layers == "minimal":
        return e * (6 + 2 * kv + mlp)
    if layers == "hf":
        return 2 * (4 + e) + e * (5 + 2 * kv + mlp)
    raise ValueError(f"layers {layers!r}: expected minimal or hf")


def attention_matrix_bytes(shape: ModelShape, seq: int, batch: int, precision: str = "bf16") -> float:
    """Korthikanti's 5·a·s²·b bytes (16-bit) per layer for eager attention; scaled by e/2 for fp32."""
    return 5 * shape.num_heads * seq * seq * batch * ELEMENT_BYTES[precision] / 2


ActivationPolicy = Callable[..., float]
ACTIVATION_POLICIES: Registry[ActivationPolicy] = Registry("activation checkpointing mode")


@ACTIVATION_POLICIES.register("none")
def activations_no_recompute(shape: ModelShape, seq: int, batch: int, precision: str, flash: bool,
                             layers: str = "minimal", expanded_kv: bool = False) -> float:
    """All layers keep everything: L · (c·s·b·h + [5·a·s²·b unless flash])."""
    per_layer = layer_activation_coefficient(shape, precision, layers, expanded_kv) * seq * batch * shape.hidden_size
    if not flash:
        per_layer += attention_matrix_bytes(shape, seq, batch, precision)
    return shape.num_layers * per_layer


@ACTIVATION_POLICIES.register("selective")
def activations_selective(shape: ModelShape, seq: int, batch: int, precision: str, flash: bool,
                          layers: str = "minimal", expanded_kv: bool = False) -> float:
    """Korthikanti's selective recompute: the attention core is recomputed, L · c·s·b·h (= none with flash)."""
    return shape.num_layers * layer_activation_coefficient(shape, precision, layers, expanded_kv) * seq * batch * shape.hidden_size


@ACTIVATION_POLICIES.register("full")
def activations_full(shape: ModelShape, seq: int, batch: int, precision: str, flash: bool,
                     layers: str = "minimal", expanded_kv: bool = False) -> float:
    """Full recompute: L block inputs e·s·b·h plus one block's working set during its backward."""
    e = ELEMENT_BYTES[precision]
    inputs = shape.num_layers * e * seq * batch * shape.hidden_size
    working = activations_no_recompute(shape, seq, batch, precision, flash, layers, expanded_kv) / shape.num_layers
    return inputs + working


@ACTIVATION_POLICIES.register("op")
def activations_per_op(shape: ModelShape, seq: int, batch: int, precision: str, flash: bool,
                       layers: str = "minimal", expanded_kv: bool = False) -> float:
    """torchtitan's per-op selective AC (``selective_ac_option = "op"``): inside each block only the outputs of
    the ops in its save list are kept — every second matmul (wq, wv, w1, w2 in call order; wk, wo, w3 are
    recomputed) and the SDPA output — plus the block input; everything elementwise (norms, RoPE, SiLU, the
    gate product) is recomputed. Per layer e·(1 + 1 + kv/h + 1 + i/h + 1)·s·b·h, plus one block's working set
    while it is recomputed in backward.
    """
    e = ELEMENT_BYTES[precision]
    kv = 1.0 if expanded_kv else shape.kv_fraction
    kept = e * (4 + kv + shape.intermediate_size / shape.hidden_size) * seq * batch * shape.hidden_size
    working = activations_no_recompute(shape, seq, batch, precision, flash, layers, expanded_kv) / shape.num_layers
    return shape.num_layers * kept + working


def logits_bytes(shape: ModelShape, seq: int, batch: int, chunk_tokens: int | None = 1024) -> float:
    """fp32 logits of the output head and their gradient: 2 · tokens · V · 4 B.

    With a chunked head (posttrain's ``train.loss_chunk_size``, default 1024 tokens) only one chunk's logits
    exist at a time: 2 · chunk · V · 4 B; without (``chunk_tokens=None``), all s·b tokens.
    """
    tokens = seq * batch if chunk_tokens is None else min(chunk_tokens, seq * batch)
    return 2 * tokens * shape.vocab_size * 4


def kv_cache_bytes(shape: ModelShape, tokens: int, batch: int, element_bytes: int = 2) -> float:
    """Rollout KV cache: 2 (K and V) · layers · kv_heads · head_dim · (prompt + completion) · batch · 2 B."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.dim_per_head * tokens * batch * element_bytes
