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

**Mixture of experts, expert parallelism (EP) × FSDP** (torchtitan's layout, ``parallel.expert``: EP ranks each
own E/EP of every MoE layer's routed experts, and those are sharded by FSDP over the N/EP ranks that own the same
experts; everything else is sharded over all N). Per GPU:

* sharded states stay 18 B · P / N (bf16): experts 18 B · P_experts / (EP · N/EP) = 18 B · P_experts / N. EP
  does not shrink the persistent state; it changes what is *gathered* and what is *sent*.
* gathered unit: an MoE block gathers its dense parts (attention, router, shared experts, norms) over N and only
  its E/EP experts over N/EP: 4 B · (P_block_dense + P_block_experts / EP), the expert part only when N/EP > 1
  (with EP = N every expert stays whole on its one rank). Without EP one DeepSeek-V3 layer gathers all 256
  experts, 11.3B parameters (42 GiB of bf16 params + grads): EP divides that by EP.
* activations: an MoE layer keeps, per token, k routed copies (input h, gate/up 2i, silu i, product i, output h)
  plus the shared experts and the router's fp32 scores (``moe_mlp_coefficient``). With EP and balanced routing a
  rank processes as many routed copies as its own tokens produce (it receives what it sends), so the same figure
  holds per GPU. Unbalanced routing is the ``imbalance`` input (``--expert-imbalance``, default 1: balanced): the
  routed copies the busiest EP rank's experts receive over the copies its own tokens send, summed over the MoE
  layers. It multiplies what the receiving rank keeps (input h, gate/up 2i, silu i, product i); the combined
  output (h, weighted on the sending rank) stays with the sender. What matters is the rank's E/EP experts
  together, not the busiest expert: in the measured tiny run (docs/plan.md) the busiest expert took 7-8x the
  mean, its EP=2 rank 1.2x. At EP = 1 a rank runs all its own copies whatever the routing (the input is ignored).
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


def gathered_unit_params(shape: ModelShape, gpus: int, expert_parallel: int = 1) -> int:
    """Parameters of the largest unit a GPU gathers at once (module docstring): the embedding or output head, a
    dense block, or an MoE block's dense parts plus its E/EP experts (those only when FSDP shards them, N/EP > 1)."""
    units = [shape.embedding_params()]
    if shape.dense_layers:
        units.append(shape.block_params())
    if shape.is_moe:
        experts = shape.moe_block_expert_params() // expert_parallel if gpus // expert_parallel > 1 else 0
        units.append(shape.moe_block_dense_params() + experts)
    return max(units)


def _attention_coefficient(shape: ModelShape, e: int, layers: str, expanded_kv: bool) -> float:
    """Bytes per s·b·h of everything but the MLP: the two norms, attention and the MLP's input (docstring)."""
    h = shape.hidden_size
    norm = e if layers == "minimal" else 4 + e  # HF's RMSNorm keeps its fp32 input beside the normalised tensor
    q, o = shape.q_width / h, shape.o_width / h
    k, v = (1.0, 1.0) if expanded_kv and not shape.is_mla else (shape.k_width / h, shape.v_width / h)
    kept_output = 2 if layers == "hf" else 1  # HF: SDPA's output and o_proj's contiguous copy of it
    extra = 0.0
    if shape.qk_norm:  # Qwen3: RMSNorm over each Q and K head, on the unexpanded widths
        extra += norm * (shape.q_width + shape.k_width) / h
    if shape.is_mla:  # the latents: q_a output (norm in, norm out), kv_a output (norm in + rope part, norm out)
        latent = shape.q_lora_rank + shape.kv_lora_rank
        extra += (norm * latent + e * (latent + shape.qk_rope_head_dim)) / h
    return 2 * norm + e * (1 + q + k + v + kept_output * o + 1) + extra


def moe_mlp_coefficient(shape: ModelShape, precision: str = "bf16", imbalance: float = 1.0) -> float:
    """Bytes per s·b·h an MoE layer's MLP keeps: each of the k routed copies of a token keeps its input (gathered
    or received, h), the gate/up output (2·i), silu(gate) (i), the product (i) and the expert output before the
    routing weight multiplies it (h); the S shared experts keep a SwiGLU's four i-wide tensors; the router keeps
    its fp32 scores (4·E bytes per token). i is moe_intermediate_size. Read from HF's grouped_mm experts
    (transformers.integrations.moe) and torchtitan's MoE, which keep the same tensors. ``imbalance`` (EP only,
    module docstring) scales what the experts' rank keeps, every routed tensor but the output: k·(1 + f·(1 + 4i/h)).
    """
    e, h, i = ELEMENT_BYTES[precision], shape.hidden_size, shape.moe_intermediate_size
    routed = shape.experts_per_token * (1 + imbalance * (1 + 4 * i / h))
    shared = shape.shared_experts * 4 * i / h
    return e * (routed + shared) + 4 * shape.num_experts / h


def layer_activation_coefficient(shape: ModelShape, precision: str = "bf16", layers: str = "minimal",
                                 expanded_kv: bool = False, moe: bool = False, imbalance: float = 1.0) -> float:
    """Bytes per s·b·h one block keeps for backward without recompute, s² terms excluded (docstring); ``moe``:
    an MoE block (``moe_mlp_coefficient``, with its routing ``imbalance``) instead of a dense one."""
    if layers not in ("minimal", "hf"):
        raise ValueError(f"layers {layers!r}: expected minimal or hf")
    e = ELEMENT_BYTES[precision]
    mlp = moe_mlp_coefficient(shape, precision, imbalance) if moe else e * 4 * shape.intermediate_size / shape.hidden_size
    return _attention_coefficient(shape, e, layers, expanded_kv) + mlp


def _layer_kinds(shape: ModelShape) -> list[tuple[int, bool]]:
    """(count, is_moe) for the dense and the MoE layers that exist."""
    kinds = [(shape.dense_layers, False), (shape.moe_layers, True)] if shape.is_moe else [(shape.num_layers, False)]
    return [(count, moe) for count, moe in kinds if count]


def attention_matrix_bytes(shape: ModelShape, seq: int, batch: int, precision: str = "bf16") -> float:
    """Korthikanti's 5·a·s²·b bytes (16-bit) per layer for eager attention; scaled by e/2 for fp32."""
    return 5 * shape.num_heads * seq * seq * batch * ELEMENT_BYTES[precision] / 2


ActivationPolicy = Callable[..., float]
ACTIVATION_POLICIES: Registry[ActivationPolicy] = Registry("activation checkpointing mode")


def _block_bytes(shape: ModelShape, seq: int, batch: int, precision: str, flash: bool, layers: str,
                 expanded_kv: bool, moe: bool, imbalance: float = 1.0) -> float:
    """One block's activations without recompute: c·s·b·h (+ 5·a·s²·b unless flash)."""
    sbh = seq * batch * shape.hidden_size
    kept = layer_activation_coefficient(shape, precision, layers, expanded_kv, moe, imbalance) * sbh
    return kept if flash else kept + attention_matrix_bytes(shape, seq, batch, precision)


def _working_set(shape: ModelShape, seq: int, batch: int, precision: str, flash: bool, layers: str,
                 expanded_kv: bool, imbalance: float = 1.0) -> float:
    """The largest block's activations, held while that block is recomputed in backward."""
    return max(_block_bytes(shape, seq, batch, precision, flash, layers, expanded_kv, moe, imbalance)
               for _, moe in _layer_kinds(shape))


@ACTIVATION_POLICIES.register("none")
def activations_no_recompute(shape: ModelShape, seq: int, batch: int, precision: str, flash: bool,
                             layers: str = "minimal", expanded_kv: bool = False, imbalance: float = 1.0) -> float:
    """All layers keep everything: Σ over layers of (c·s·b·h + [5·a·s²·b unless flash]); c of MoE layers differs."""
    return sum(count * _block_bytes(shape, seq, batch, precision, flash, layers, expanded_kv, moe, imbalance)
               for count, moe in _layer_kinds(shape))


@ACTIVATION_POLICIES.register("selective")
def activations_selective(shape: ModelShape, seq: int, batch: int, precision: str, flash: bool,
                          layers: str = "minimal", expanded_kv: bool = False, imbalance: float = 1.0) -> float:
    """Korthikanti's selective recompute: the attention core is recomputed, Σ c·s·b·h (= none with flash)."""
    return activations_no_recompute(shape, seq, batch, precision, True, layers, expanded_kv, imbalance)


@ACTIVATION_POLICIES.register("full")
def activations_full(shape: ModelShape, seq: int, batch: int, precision: str, flash: bool,
                     layers: str = "minimal", expanded_kv: bool = False, imbalance: float = 1.0) -> float:
    """Full recompute: L block inputs e·s·b·h plus the largest block's working set during its backward."""
    e = ELEMENT_BYTES[precision]
    inputs = shape.num_layers * e * seq * batch * shape.hidden_size
    return inputs + _working_set(shape, seq, batch, precision, flash, layers, expanded_kv, imbalance)


@ACTIVATION_POLICIES.register("op")
def activations_per_op(shape: ModelShape, seq: int, batch: int, precision: str, flash: bool,
                       layers: str = "minimal", expanded_kv: bool = False, imbalance: float = 1.0) -> float:
    """torchtitan's per-op selective AC (``selective_ac_option = "op"``): inside each block only the outputs of
    the ops in its save list are kept — every second matmul (wq, wv, w1, w2 in call order; wk, wo, w3 are
    recomputed) and the SDPA output — plus the block input; everything elementwise (norms, RoPE, SiLU, the
    gate product) is recomputed. Per layer e·(1 + q/h + v/h + o/h + i/h + 1)·s·b·h (Llama: e·(4 + kv/h + i/h)),
    plus one block's working set while it is recomputed in backward. An MoE layer keeps w1's and w2's outputs
    for each of its k routed copies and S shared experts, k·(i/h + 1) + S·(i/h + 1), and the router's fp32
    scores (an approximation: the parity of "every second matmul" inside grouped expert matmuls is not modelled);
    both routed outputs are kept by the experts' rank, so ``imbalance`` scales all of that routed part.
    """
    e, h = ELEMENT_BYTES[precision], shape.hidden_size
    kv = 1.0 if expanded_kv and not shape.is_mla else shape.v_width / h
    attention = 1 + shape.q_width / h + kv + shape.o_width / h
    sbh = seq * batch * h
    kept = 0.0
    for count, moe in _layer_kinds(shape):
        if moe:
            i = shape.moe_intermediate_size / h
            routed = imbalance * shape.experts_per_token
            mlp = e * (routed + shape.shared_experts) * (i + 1) + 4 * shape.num_experts / h
        else:
            mlp = e * (shape.intermediate_size / h + 1)
        kept += count * (e * attention + mlp) * sbh
    return kept + _working_set(shape, seq, batch, precision, flash, layers, expanded_kv, imbalance)


def logits_bytes(shape: ModelShape, seq: int, batch: int, chunk_tokens: int | None = 1024) -> float:
    """fp32 logits of the output head and their gradient: 2 · tokens · V · 4 B.

    With a chunked head (posttrain's ``train.loss_chunk_size``, default 1024 tokens) only one chunk's logits
    exist at a time: 2 · chunk · V · 4 B; without (``chunk_tokens=None``), all s·b tokens.
    """
    tokens = seq * batch if chunk_tokens is None else min(chunk_tokens, seq * batch)
    return 2 * tokens * shape.vocab_size * 4


def kv_cache_bytes(shape: ModelShape, tokens: int, batch: int, element_bytes: int = 2) -> float:
    """Rollout KV cache: 2 (K and V) · layers · kv_heads · head_dim · (prompt + completion) · batch · 2 B.

    MLA caches its latent instead, layers · (kv_lora_rank + qk_rope_head_dim) per token, as vLLM and SGLang do
    (HF's eager cache holds the decompressed per-head K and V, 2·heads·192/576 ≈ 85× more for DeepSeek-V3).
    """
    if shape.is_mla:
        return shape.num_layers * (shape.kv_lora_rank + shape.qk_rope_head_dim) * tokens * batch * element_bytes
    return 2 * shape.num_layers * shape.num_kv_heads * shape.dim_per_head * tokens * batch * element_bytes
