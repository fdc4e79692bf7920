"""Step time, FSDP communication, checkpoint cost, checkpoint interval and goodput.

* FLOPs per step (model FLOPs, fwd + bwd): 6·N·T (Kaplan et al. 2020, 2N forward + 4N backward per token) plus
  attention 12·L·s²·h per sequence (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters", eq. 3: the s/6h term of 72·B·s·L·h²·(1 + s/6h + V/12hL)). The causal mask is not halved, as in
  those papers; recompute FLOPs are not counted (MFU is a model-FLOPs figure), so set ``mfu`` lower for full AC.
* Step time = FLOPs / (GPUs · MFU · peak), or the FSDP communication time where that is longer (not hidden). The
  peak is the GPU preset's bf16 dense figure (posttrain/plan/hardware.py; default H100 SXM, 989 TFLOP/s).
* FSDP traffic per GPU per micro-batch (ring collectives move (N−1)/N of the buffer through each GPU):
  all-gather of bf16 params in forward and again in backward (``reshard_after_forward=True``), 2 · 2P·(N−1)/N B,
  and a reduce-scatter of fp32 gradients (``reduce_dtype=fp32``), 4P·(N−1)/N B. It hides behind compute when
  its time at the given per-GPU bandwidth is at most the micro-batch's compute time (FSDP prefetches the next
  unit's all-gather while the current one computes).
* Mixture of experts: FLOPs count the parameters a token computes with (``ModelShape.flop_params``: k of E
  routed experts), and attention's s² term uses MLA's widths (QKᵀ over heads·(nope+rope), AV over heads·v).
  FSDP traffic splits: the dense parts over all N GPUs, each EP rank's E/EP experts over the N/EP ranks that own
  them. **All-to-all** (expert parallelism): each MoE layer sends every routed copy of a token (k per token, h
  wide) to the rank owning its expert (dispatch) and back (combine), in forward, and the gradients of both in
  backward; with balanced routing (EP−1)/EP of the copies leave the rank: per GPU per micro-batch
  2 (dispatch + combine) · passes · moe_layers · tokens · k · h · e · (EP−1)/EP bytes sent (as many received),
  passes = 2 (forward, backward) or 3 with full AC (the recomputed forward repeats it), e = 2 (bf16). Its time
  at the per-GPU bandwidth is added to the step: a dispatch must finish before its experts run, and posttrain
  (like torchtitan without DualPipe-style overlap) does not hide it.
* Checkpoint: DCP saves fp32 parameters + Adam m, v = 12 B/param; save time = size / store bandwidth.
* Interval: Young 1974 / Daly 2006 first order, τ = √(2·C·M) with C the save time and M the job's mean time
  between unannounced failures.
* Goodput (fraction of wall time that is useful training), first-order model: each failure without usable
  notice loses τ/2 of work on average plus the restart R; a preemption whose notice covers a save loses C + R;
  saving costs C every τ. G = 1 − C/τ − λ_u·(τ/2 + R) − λ_n·(C + R), with λ_u, λ_n the job's rates of
  unannounced and announced interruptions (per second). Cost = wall time · GPUs · blended $/GPU-hour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.plan.shapes import ModelShape


def step_flops(shape: ModelShape, seq: int, sequences: int) -> float:
    """Model FLOPs of one forward + backward over ``sequences`` sequences of ``seq`` tokens: 6·N·T with N the
    parameters a token computes with (``flop_params``), plus 6·L·s²·(q + o widths) per sequence (= 12·L·s²·h for
    a Llama block, where both widths are h)."""
    tokens = seq * sequences
    dense = 6.0 * shape.flop_params() * tokens
    attention = 6.0 * shape.num_layers * seq * seq * (shape.q_width + shape.o_width) * sequences
    return dense + attention


def compute_seconds(flops: float, gpus: int, mfu: float, peak_tflops: float) -> float:
    return flops / (gpus * mfu * peak_tflops * 1e12)


def fsdp_bytes_per_gpu(params: int, gpus: int, param_bytes: int = 2, grad_bytes: int = 4) -> dict[str, float]:
    """Bytes each GPU sends (= receives) per micro-batch: two all-gathers and one reduce-scatter (ring)."""
    share = (gpus - 1) / gpus
    gather = param_bytes * params * share
    return {"all_gather_forward": gather, "all_gather_backward": gather,
            "reduce_scatter": grad_bytes * params * share}


def moe_fsdp_bytes_per_gpu(shape: ModelShape, gpus: int, expert_parallel: int = 1, param_bytes: int = 2,
                           grad_bytes: int = 4) -> dict[str, float]:
    """FSDP traffic under EP × FSDP: the non-expert parameters over all N GPUs, each rank's E/EP experts over the
    N/EP ranks that shard them (module docstring). For a dense model, ``fsdp_bytes_per_gpu`` of all of them."""
    experts = shape.routed_expert_params()
    dense = fsdp_bytes_per_gpu(shape.total_params() - experts, gpus, param_bytes, grad_bytes)
    if not experts:
        return dense
    local = fsdp_bytes_per_gpu(experts // expert_parallel, gpus // expert_parallel, param_bytes, grad_bytes)
    return {key: dense[key] + local[key] for key in dense}


def all_to_all_bytes_per_gpu(shape: ModelShape, tokens: int, expert_parallel: int, element_bytes: int = 2,
                             recompute: bool = False) -> dict[str, float]:
    """Bytes each GPU sends (= receives) in the MoE all-to-alls of one micro-batch of ``tokens`` tokens per GPU:
    per MoE layer and pass, dispatch and combine each move tokens · k · h · e · (EP−1)/EP (module docstring).
    ``recompute``: full AC runs the forward's two all-to-alls again in backward."""
    if not shape.is_moe or expert_parallel <= 1:
        return {"dispatch_forward": 0.0, "combine_forward": 0.0, "backward": 0.0, "recompute": 0.0}
    one = (shape.moe_layers * tokens * shape.experts_per_token * shape.hidden_size * element_bytes
           * (expert_parallel - 1) / expert_parallel)
    return {"dispatch_forward": one, "combine_forward": one, "backward": 2 * one,
            "recompute": 2 * one if recompute else 0.0}


def checkpoint_bytes(params: int) -> float:
    """fp32 parameters + Adam m, v (the gradients are not saved)."""
    return 12.0 * params


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """τ = √(2·C·M) (Young 1974; Daly 2006, first order). Infinite when nothing fails."""
    if math.isinf(mtbf_seconds):
        return math.inf
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


@dataclass(frozen=True)
class Interruptions:
    unannounced_per_s: float  # hardware failures + preemptions whose notice is shorter than a save
    announced_per_s: float  # preemptions whose notice covers an emergency save
    restart_s: float


def interruptions(nodes: int, spot_nodes: int, node_mtbf_hours: float, preemptions_per_node_hour: float,
                  notice_s: float, save_s: float, restart_s: float) -> Interruptions:
    """Job-level rates: every node fails at 1/MTBF; spot nodes are also preempted at the given rate."""
    hardware = nodes / (node_mtbf_hours * 3600.0) if node_mtbf_hours > 0 else 0.0
    preempt = spot_nodes * preemptions_per_node_hour / 3600.0
    if notice_s >= save_s:
        return Interruptions(hardware, preempt, restart_s)
    return Interruptions(hardware + preempt, 0.0, restart_s)


def goodput(interval_s: float, save_s: float, rates: Interruptions) -> float:
    """G = 1 − C/τ − λ_u·(τ/2 + R) − λ_n·(C + R), clipped to [0, 1] (module docstring)."""
    if math.isinf(interval_s):
        lost = rates.announced_per_s * (save_s + rates.restart_s)
        return max(0.0, 1.0 - lost)
    value = (1.0 - save_s / interval_s - rates.unannounced_per_s * (interval_s / 2 + rates.restart_s)
             - rates.announced_per_s * (save_s + rates.restart_s))
    return min(1.0, max(0.0, value))


def best_interval(save_s: float, rates: Interruptions) -> float:
    """Young/Daly on the unannounced rate (announced preemptions do not depend on τ)."""
    if rates.unannounced_per_s <= 0:
        return math.inf
    return young_daly_interval(save_s, 1.0 / rates.unannounced_per_s)
