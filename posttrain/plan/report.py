"""Put the formulas together for one run: a plan as a dict (written as JSON) and as readable text."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from posttrain.plan import memory, timing
from posttrain.plan.hardware import DEFAULT_GPU, GPU_PRESETS
from posttrain.plan.memory import GIB
from posttrain.plan.shapes import ModelShape


@dataclass(frozen=True)
class PlanInputs:
    gpus: int
    gpus_per_node: int
    recipe: str = "sft"
    offload: str = "none"
    ac: str = "selective"
    seq: int = 4096  # grpo: prompt_len + completion_len, which set the sequence there
    micro_batch: int = 1
    precision: str = "bf16"
    flash: bool = True
    layers: str = "hf"  # hf: HF transformers' Llama layers as posttrain trains them; minimal: Korthikanti-style
    reference: str = "none"  # live: a frozen reference model sharded like the policy (DPO live, GRPO with KL)
    padded: bool = False  # an attention mask is passed (padded batches): HF expands K, V to all heads
    loss_chunk: int | None = 1024
    prompt_len: int = 512  # GRPO rollouts
    completion_len: int = 1024
    rollout_batch: int = 8
    mfu: float = 0.4
    expert_parallel: int = 1  # EP: ranks each MoE layer's routed experts are split over (parallel.expert)
    expert_imbalance: float = 1.0  # EP > 1: busiest EP rank's received routed copies over its sent (memory.py)
    gpu: str = DEFAULT_GPU  # the preset the next three figures came from (posttrain/plan/hardware.py)
    gpu_memory_gib: float = GPU_PRESETS[DEFAULT_GPU].memory_gib
    peak_tflops: float = GPU_PRESETS[DEFAULT_GPU].peak_tflops  # bf16 dense
    hbm_tbps: float = GPU_PRESETS[DEFAULT_GPU].hbm_tbps  # recorded, not used by a formula yet (hardware.py)
    gpu_overridden: tuple[str, ...] = ()  # flags that replaced a preset figure (--gpu-memory, ...)
    bandwidth_gbps: float = 400.0  # per GPU, Gbit/s
    store_gbps: float = 100.0  # aggregate checkpoint write bandwidth, Gbit/s
    node_mtbf_hours: float = 5000.0
    spot_fraction: float = 0.0
    spot_price: float = 2.0  # $ per GPU-hour
    ondemand_price: float = 4.0
    preemptions_per_hour: float = 0.05  # per spot node
    notice_s: float = 30.0
    restart_s: float = 600.0
    train_tokens: float = 1e10


def expert_parallel_problems(shape: ModelShape, gpus: int, expert_parallel: int) -> list[str]:
    """Why ``expert_parallel`` cannot shard ``shape`` over ``gpus`` GPUs (empty when it can), each with the fix."""
    ep = expert_parallel
    if ep < 1:
        return ["--expert-parallel must be at least 1"]
    if ep == 1:
        return []
    if not shape.is_moe:
        return [f"--expert-parallel {ep}: {shape.name} is dense (no routed experts); drop --expert-parallel"]
    problems = []
    if shape.num_experts % ep:
        problems.append(f"--expert-parallel {ep} does not divide the {shape.num_experts} routed experts of "
                        f"{shape.name}; use a divisor of {shape.num_experts}")
    if gpus % ep:
        problems.append(f"--expert-parallel {ep} does not divide --gpus {gpus}: EP groups are whole; use a GPU count "
                        f"that is a multiple of {ep}")
    return problems


def build_plan(shape: ModelShape, inputs: PlanInputs) -> dict:
    """Every figure of the plan, in bytes / seconds / dollars, plus GiB conveniences for reading."""
    problems = expert_parallel_problems(shape, inputs.gpus, inputs.expert_parallel)
    if problems:
        raise ValueError("; ".join(problems))
    params, ep = shape.total_params(), inputs.expert_parallel
    # DPO: chosen and rejected go through the policy together, doubling the batch; the reference log-probs are
    # precomputed (posttrain caches them), so no reference model is resident.
    sequences = inputs.micro_batch * (2 if inputs.recipe == "dpo" else 1)
    seq = inputs.prompt_len + inputs.completion_len if inputs.recipe == "grpo" else inputs.seq
    unit = memory.gathered_unit_params(shape, inputs.gpus, ep)
    states = memory.model_states(params, unit, inputs.gpus, inputs.gpus_per_node, inputs.precision, inputs.offload)
    imbalance = inputs.expert_imbalance if ep > 1 else 1.0  # at EP 1 a rank runs all its own routed copies
    activations = memory.ACTIVATION_POLICIES.get(inputs.ac)(shape, seq, sequences, inputs.precision, inputs.flash,
                                                            inputs.layers, inputs.padded and inputs.layers == "hf",
                                                            imbalance=imbalance)
    logits = memory.logits_bytes(shape, seq, sequences, inputs.loss_chunk)
    kv_cache = (memory.kv_cache_bytes(shape, seq, inputs.rollout_batch) if inputs.recipe == "grpo" else 0.0)
    # A live reference is frozen: its parameters only, sharded like the policy, in the compute dtype.
    reference = (memory.ELEMENT_BYTES[inputs.precision] * params / inputs.gpus if inputs.reference == "live" else 0.0)
    training_transient = states.gathered_gpu + activations + logits
    # Rollouts and the training step do not overlap in time: the peak is the larger of the two on top of states.
    peak = states.sharded_gpu + reference + max(training_transient, states.gathered_gpu + kv_cache)
    memory_part = {
        "sharded_states": states.sharded_gpu, "gathered_unit": states.gathered_gpu, "activations": activations,
        "logits": logits, "reference_model": reference, "rollout_kv_cache": kv_cache, "peak_per_gpu": peak,
        "host_per_node": states.host_per_node,
    }
    if shape.is_moe:  # the routed experts' share of the sharded states, and of the gathered unit
        experts = memory.model_states(shape.routed_expert_params(), 0, inputs.gpus, inputs.gpus_per_node,
                                      inputs.precision, inputs.offload)
        share = shape.moe_block_expert_params() // ep if inputs.gpus // ep > 1 else 0  # this GPU's E/EP experts
        largest = inputs.gpus > 1 and shape.moe_block_dense_params() + share == unit
        memory_part["expert_states"] = experts.sharded_gpu
        memory_part["gathered_experts"] = memory.GATHERED_BYTES[inputs.precision] * share if largest else 0.0

    flops = timing.step_flops(shape, seq, sequences)
    compute_s = timing.compute_seconds(flops, 1, inputs.mfu, inputs.peak_tflops)  # one micro-batch on one GPU
    element = memory.ELEMENT_BYTES[inputs.precision]
    traffic = timing.moe_fsdp_bytes_per_gpu(shape, inputs.gpus, ep, element, 4)
    bytes_per_s = inputs.bandwidth_gbps * 1e9 / 8
    comm_s = sum(traffic.values()) / bytes_per_s
    a2a = timing.all_to_all_bytes_per_gpu(shape, seq * sequences, ep, element, recompute=inputs.ac == "full")
    a2a_s = sum(a2a.values()) / bytes_per_s
    # FSDP traffic that does not hide behind compute sets the pace: a micro-batch takes the longer of the two;
    # the MoE all-to-alls sit on the critical path and add to it (timing module docstring).
    tokens_per_s = seq * sequences * inputs.gpus / (max(compute_s, comm_s) + a2a_s)
    comms = {**traffic, "total_bytes": sum(traffic.values()), "seconds": comm_s, "compute_seconds": compute_s,
             "hidden": comm_s <= compute_s, "all_to_all": a2a, "all_to_all_bytes": sum(a2a.values()),
             "all_to_all_seconds": a2a_s}

    nodes = math.ceil(inputs.gpus / inputs.gpus_per_node)
    spot_nodes = round(nodes * inputs.spot_fraction)
    ckpt_bytes = timing.checkpoint_bytes(params)
    save_s = ckpt_bytes / (inputs.store_gbps * 1e9 / 8)
    rates = timing.interruptions(nodes, spot_nodes, inputs.node_mtbf_hours, inputs.preemptions_per_hour,
                                 inputs.notice_s, save_s, inputs.restart_s)
    interval = timing.best_interval(save_s, rates)
    good = timing.goodput(interval, save_s, rates)
    useful_s = inputs.train_tokens / tokens_per_s
    wall_s = useful_s / good if good > 0 else math.inf
    price = (spot_nodes * inputs.spot_price + (nodes - spot_nodes) * inputs.ondemand_price) / nodes
    run = {
        "nodes": nodes, "spot_nodes": spot_nodes, "step_flops": flops, "tokens_per_s": tokens_per_s,
        "mfu": inputs.mfu, "checkpoint_bytes": ckpt_bytes, "checkpoint_save_s": save_s,
        "unannounced_interruptions_per_hour": rates.unannounced_per_s * 3600,
        "announced_interruptions_per_hour": rates.announced_per_s * 3600,
        "checkpoint_interval_s": interval, "goodput": good, "useful_hours": useful_s / 3600,
        "wall_hours": wall_s / 3600, "price_per_gpu_hour": price,
        "cost_dollars": wall_s / 3600 * inputs.gpus * price,
    }
    return {"model": shape.to_dict(), "inputs": asdict(inputs), "memory_bytes": memory_part,
            "communication_per_microbatch": comms, "run": run}


def _gib(value: float) -> str:
    return f"{value / GIB:,.1f} GiB"


def _minutes(seconds: float) -> str:
    return "never (no failures)" if math.isinf(seconds) else f"{seconds / 60:,.1f} min"


def _sequence(inp: dict) -> str:
    if inp["recipe"] != "grpo":
        return f"seq {inp['seq']}"
    return (f"seq {inp['prompt_len'] + inp['completion_len']} (prompt {inp['prompt_len']} + completion "
            f"{inp['completion_len']})")


def format_plan(plan: dict) -> str:
    """The plan as text; its last line is the verdict when ``plan`` carries one (posttrain/plan/fit.py)."""
    model, inp, mem = plan["model"], plan["inputs"], plan["memory_bytes"]
    comm, run = plan["communication_per_microbatch"], plan["run"]
    overridden = inp["gpu_overridden"]
    params = f"{model['total_params'] / 1e9:,.2f}B params"
    if "active_params" in model:
        params += (f", {model['active_params'] / 1e9:,.2f}B active; {model['num_experts']} experts, "
                   f"{model['experts_per_token']} per token, EP {inp['expert_parallel']}")
        if inp["expert_parallel"] > 1 and inp["expert_imbalance"] != 1:
            params += f", routing imbalance {inp['expert_imbalance']:g}"
    lines = [
        f"plan: {model['name']} ({params}), {inp['recipe']}, "
        f"{inp['gpus']} GPUs ({run['nodes']} nodes × {inp['gpus_per_node']}), {inp['precision']}, "
        f"{_sequence(inp)}, "
        f"micro-batch {inp['micro_batch']}, AC {inp['ac']}, offload {inp['offload']}, {inp['layers']} layers",
        f"GPU {inp['gpu']}: {inp['gpu_memory_gib']:g} GiB, {inp['peak_tflops']:g} TFLOP/s bf16 dense, "
        f"{inp['hbm_tbps']:g} TB/s HBM" + (f" (overridden: {', '.join(overridden)})" if overridden else ""),
        "memory per GPU",
        f"  params+grads+Adam (sharded)  {_gib(mem['sharded_states'])}" + (
            f" (routed experts {_gib(mem['expert_states'])})" if "expert_states" in mem else ""),
        f"  gathered largest unit        {_gib(mem['gathered_unit'])}" + (
            f" (its {model['num_experts'] // inp['expert_parallel']} of {model['num_experts']} experts "
            f"{_gib(mem['gathered_experts'])})" if mem.get("gathered_experts") else ""),
        f"  activations                  {_gib(mem['activations'])}",
        f"  logits (chunked head)        {_gib(mem['logits'])}",
    ]
    if inp["reference"] == "live":
        lines.append(f"  reference model (live)       {_gib(mem['reference_model'])}")
    elif inp["recipe"] == "dpo":
        lines.append("  reference model              0.0 GiB (log-probs precomputed; chosen+rejected double the batch)")
    if inp["recipe"] == "grpo":
        lines.append(f"  rollout KV cache             {_gib(mem['rollout_kv_cache'])} (batch {inp['rollout_batch']})")
    lines.append(f"  peak                         {_gib(mem['peak_per_gpu'])}")
    if inp["offload"] != "none":
        lines.append(f"  host memory per node         {_gib(mem['host_per_node'])} ({inp['offload']} offload)")
    lines += [
        "communication per micro-batch (FSDP, per GPU)",
        f"  all-gather fwd+bwd {2 * comm['all_gather_forward'] / 1e9:,.1f} GB, reduce-scatter "
        f"{comm['reduce_scatter'] / 1e9:,.1f} GB: {comm['seconds']:,.2f} s at {inp['bandwidth_gbps']:g} Gb/s vs "
        f"compute {comm['compute_seconds']:,.2f} s: {'hidden' if comm['hidden'] else 'NOT hidden (communication-bound)'}",
    ]
    if "active_params" in model and inp["expert_parallel"] == 1:
        lines.append("  all-to-all: none (EP 1: no expert parallelism; FSDP gathers every expert instead)")
    elif "active_params" in model:
        lines.append(
            f"  all-to-all (EP {inp['expert_parallel']}, {model['moe_layers']} MoE layers, dispatch+combine, fwd+bwd"
            + (", recomputed fwd" if comm["all_to_all"]["recompute"] else "") + f") "
            f"{comm['all_to_all_bytes'] / 1e9:,.1f} GB: {comm['all_to_all_seconds']:,.2f} s at "
            f"{inp['bandwidth_gbps']:g} Gb/s, not hidden")
    lines += [
        "time and goodput",
        f"  throughput        {run['tokens_per_s']:,.0f} tokens/s (MFU {inp['mfu']:g} × {inp['peak_tflops']:g} TFLOP/s, "
        f"or the communication time where it is longer" + (", plus the all-to-alls)" if "active_params" in model
                                                           else ")"),
        f"  checkpoint        {run['checkpoint_bytes'] / 1e9:,.0f} GB, save {run['checkpoint_save_s']:,.0f} s at "
        f"{inp['store_gbps']:g} Gb/s",
        f"  interruptions     {run['unannounced_interruptions_per_hour']:.3g}/h unannounced, "
        f"{run['announced_interruptions_per_hour']:.3g}/h with notice ({run['spot_nodes']} spot nodes)",
        f"  save every        {_minutes(run['checkpoint_interval_s'])} (Young/Daly)",
        f"  goodput           {run['goodput']:.1%}",
        f"  run               {inp['train_tokens']:.3g} tokens: " + (
            f"{run['wall_hours']:,.1f} h wall, ${run['cost_dollars']:,.0f} at ${run['price_per_gpu_hour']:.2f}/GPU-h"
            if math.isfinite(run["wall_hours"]) else "never finishes: interruptions eat all the time"),
    ]
    if "verdict" in plan:
        lines.append(f"verdict: {plan['verdict']['text']}")
    return "\n".join(lines)
