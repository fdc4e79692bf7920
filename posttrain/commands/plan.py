"""``posttrain plan``: memory per GPU, communication, step time, checkpoint interval, goodput and cost on paper.

The formulas and their sources are in posttrain/plan/ and docs/plan.md. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from posttrain.plan.hardware import GPU_PRESETS

EXIT_DOES_NOT_FIT = 3  # with --check: the plan's peak per GPU is over the GPU's memory

EPILOG = f"""\
exit codes: 0 the plan was printed (without --check, whether or not the run fits), 2 bad input,
            {EXIT_DOES_NOT_FIT} with --check: the run does not fit in GPU memory (plan and verdict still printed and
            written)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="Plan a run on paper: memory per GPU, FSDP traffic, step time, checkpoint interval, goodput.",
        description="Estimate a ZeRO-3/FSDP2 run's memory per GPU (MoE: total vs active parameters, experts under\n"
                    "expert parallelism x FSDP), communication (FSDP; MoE all-to-all), step time, Young/Daly checkpoint\n"
                    "interval, goodput and cost for a spot/on-demand mix, and say whether it fits the GPUs: the last\n"
                    "line is the verdict, with the smallest GPU count that fits and the --ac / --offload settings that\n"
                    "would make it fit. Formulas, GPU presets and validation: docs/plan.md.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="preset (llama3-8b, llama3-70b, llama3-405b, dense-1t; MoE: deepseek-v3, kimi-k2) or an "
                             "HF config.json path (Llama-style, qwen3_moe, deepseek_v3)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs sharding the model (FSDP world size)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--expert-parallel", type=int, default=1, metavar="EP",
                        help="MoE: ranks each layer's routed experts are split over (parallel.expert); FSDP shards "
                             "each rank's experts over the other GPUS/EP ranks. Must divide --gpus and the experts")
    parser.add_argument("--expert-imbalance", type=float, default=1.0, metavar="F",
                        help="MoE at EP > 1: routed copies the busiest EP rank's experts receive over those its own "
                             "tokens send (1: balanced routing, the default; docs/plan.md)")
    parser.add_argument("--recipe", choices=("sft", "dpo", "grpo"), default="sft",
                        help="dpo: chosen+rejected double the batch, reference log-probs precomputed; grpo: adds "
                             "the rollout KV cache")
    parser.add_argument("--reference", choices=("none", "live"), default="none",
                        help="none: DPO reference log-probs precomputed (default), GRPO without KL; live: a frozen "
                             "reference model sharded like the policy (dpo.reference=live, GRPO with rl.kl_beta > 0)")
    parser.add_argument("--offload", choices=("none", "optimizer", "params"), default="none")
    parser.add_argument("--ac", choices=("none", "selective", "op", "full"), default="selective",
                        help="activation checkpointing: selective = Korthikanti et al. 2022 (attention core "
                             "recomputed); op = torchtitan's per-op selective AC; full = whole blocks")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per sequence (default 4096); grpo: prompt + completion (train.max_length), "
                             "split as --completion-len (default 1024) and the rest")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences (pairs for dpo) per GPU per micro-step")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--no-flash", dest="flash", action="store_false",
                        help="eager attention: the s² attention matrix is stored (unless --ac selective/full)")
    parser.add_argument("--layers", choices=("hf", "minimal"), default="hf",
                        help="activation bookkeeping: hf (HF transformers' Llama layers, as posttrain trains them) "
                             "or minimal (Korthikanti et al. 2022 for a Llama block)")
    parser.add_argument("--padded", action="store_true",
                        help="batches carry an attention mask (padding): HF expands K and V to all heads")
    parser.add_argument("--loss-chunk", type=int, default=1024,
                        help="tokens per output-head chunk (train.loss_chunk_size); 0: the whole s·b logits")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="grpo: prompt tokens (default 512, or --seq minus the completion)")
    parser.add_argument("--completion-len", type=int, default=None,
                        help="grpo: completion tokens, rl.max_new_tokens (default 1024, or --seq minus the prompt)")
    parser.add_argument("--rollout-batch", type=int, default=None,
                        help="grpo: sequences generated at once per GPU (default 8)")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    parser.add_argument("--gpu", choices=tuple(GPU_PRESETS), default=None,
                        help="GPU preset: memory, bf16 dense peak and HBM bandwidth (docs/plan.md has the table and "
                             "sources); default h100. --gpu-memory, --peak-tflops, --hbm-tbps override its figures")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                        help="memory per GPU the verdict checks the peak against (h100: 80)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-GPU bf16 dense peak (h100: 989)")
    parser.add_argument("--hbm-tbps", type=float, default=None,
                        help="HBM bandwidth, TB/s (h100: 3.35); recorded in the plan, no formula uses it yet")
    parser.add_argument("--bandwidth-gbps", type=float, default=400.0, help="per-GPU network bandwidth, Gbit/s")
    parser.add_argument("--store-gbps", type=float, default=100.0, help="checkpoint store write bandwidth, Gbit/s")
    parser.add_argument("--mtbf-hours", type=float, default=5000.0, help="mean time between failures of one node")
    parser.add_argument("--spot-fraction", type=float, default=0.0, help="fraction of nodes on spot capacity")
    parser.add_argument("--spot-price", type=float, default=2.0, help="$ per GPU-hour on spot")
    parser.add_argument("--ondemand-price", type=float, default=4.0, help="$ per GPU-hour on demand")
    parser.add_argument("--preemptions-per-hour", type=float, default=0.05, help="per spot node")
    parser.add_argument("--notice-s", type=float, default=30.0, help="preemption notice, seconds")
    parser.add_argument("--restart-s", type=float, default=600.0, help="seconds from a failure to training again")
    parser.add_argument("--train-tokens", type=float, default=1e10, help="tokens the whole run trains on")
    parser.add_argument("--json", dest="json_out", help="write the plan as JSON to this file (with its verdict)")
    parser.add_argument("--check", action="store_true",
                        help=f"exit {EXIT_DOES_NOT_FIT} when the run does not fit in GPU memory (for scripts and CI)")
    parser.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    from posttrain.config.loader import ConfigError

    problems = []
    for name in ("gpus", "gpus_per_node", "expert_parallel", "seq", "micro_batch", "prompt_len", "completion_len",
                 "rollout_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1")
    if args.expert_imbalance < 1:
        problems.append("--expert-imbalance must be at least 1 (1: balanced routing)")
    if not 0 < args.mfu <= 1:
        problems.append("--mfu must be in (0, 1]")
    if not 0 <= args.spot_fraction <= 1:
        problems.append("--spot-fraction must be in [0, 1]")
    for name in ("gpu_memory", "peak_tflops", "hbm_tbps", "bandwidth_gbps", "store_gbps", "train_tokens"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            problems.append(f"--{name.replace('_', '-')} must be positive")
    if problems:
        raise ConfigError(["; ".join(problems)])


def sequence_lengths(recipe: str, seq: int | None, prompt_len: int | None,
                     completion_len: int | None) -> tuple[int, int, int]:
    """(sequence, prompt, completion) tokens from the flags given (None: not given); ConfigError if they clash.

    sft and dpo train on ``--seq`` tokens (default 4096); the prompt and completion flags would be ignored there, so
    they are refused. GRPO trains on prompt + completion, as its config does (``train.max_length`` holds the prompt
    and ``rl.max_new_tokens`` of completion): ``--seq`` is that total, and of the three flags any two set the
    third. Defaults: prompt 512, completion 1024; with ``--seq`` alone the completion stays 1024 and the prompt
    takes the rest. Only the total enters the memory and time figures; the split is shown in the header.
    """
    from posttrain.config.loader import ConfigError

    if recipe != "grpo":
        if prompt_len is not None or completion_len is not None:
            raise ConfigError([f"--prompt-len and --completion-len apply to --recipe grpo only; {recipe} sequences "
                               "are --seq tokens long"])
        return (4096 if seq is None else seq), 512, 1024
    if seq is None:
        prompt, completion = (512 if prompt_len is None else prompt_len), (1024 if completion_len is None
                                                                            else completion_len)
        return prompt + completion, prompt, completion
    if prompt_len is not None and completion_len is not None:
        if prompt_len + completion_len != seq:
            raise ConfigError([f"--seq {seq} is GRPO's whole sequence, but --prompt-len {prompt_len} + "
                               f"--completion-len {completion_len} = {prompt_len + completion_len}; give two of the "
                               "three"])
        return seq, prompt_len, completion_len
    if prompt_len is not None:
        if prompt_len >= seq:
            raise ConfigError([f"--seq {seq} leaves no room for the completion after --prompt-len {prompt_len} "
                               "(GRPO's sequence is prompt + completion); raise --seq"])
        return seq, prompt_len, seq - prompt_len
    completion = 1024 if completion_len is None else completion_len
    if completion >= seq:
        raise ConfigError([f"--seq {seq} leaves no room for the prompt after --completion-len {completion} (GRPO's "
                           "sequence is prompt + completion, as train.max_length holds rl.max_new_tokens); raise "
                           "--seq or lower --completion-len"])
    return seq, seq - completion, completion


def _finite(value):
    """JSON has no infinity: an interval that is never needed (nothing fails) is written as null."""
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    if isinstance(value, float) and math.isinf(value):
        return None
    return value


def run(args: argparse.Namespace) -> int:
    from posttrain.config.loader import ConfigError
    from posttrain.plan.fit import fit_verdict
    from posttrain.plan.hardware import resolve_gpu
    from posttrain.plan.report import PlanInputs, build_plan, expert_parallel_problems, format_plan
    from posttrain.plan.shapes import load_shape

    _check(args)
    seq, prompt_len, completion_len = sequence_lengths(args.recipe, args.seq, args.prompt_len, args.completion_len)
    if args.rollout_batch is not None and args.recipe != "grpo":
        raise ConfigError([f"--rollout-batch applies to --recipe grpo only; {args.recipe} generates nothing"])
    gpu = resolve_gpu(args.gpu, args.gpu_memory, args.peak_tflops, args.hbm_tbps)
    shape = load_shape(args.model)
    problems = expert_parallel_problems(shape, args.gpus, args.expert_parallel)
    if problems:
        raise ConfigError(problems)
    inputs = PlanInputs(
        gpus=args.gpus, gpus_per_node=args.gpus_per_node, recipe=args.recipe, offload=args.offload, ac=args.ac,
        seq=seq, micro_batch=args.micro_batch, precision=args.precision, flash=args.flash,
        layers=args.layers, padded=args.padded, reference=args.reference,
        loss_chunk=args.loss_chunk or None, prompt_len=prompt_len, completion_len=completion_len,
        rollout_batch=8 if args.rollout_batch is None else args.rollout_batch, mfu=args.mfu,
        expert_parallel=args.expert_parallel, expert_imbalance=args.expert_imbalance,
        gpu=gpu.name, gpu_memory_gib=gpu.memory_gib, peak_tflops=gpu.peak_tflops, hbm_tbps=gpu.hbm_tbps,
        gpu_overridden=gpu.overridden,
        bandwidth_gbps=args.bandwidth_gbps, store_gbps=args.store_gbps, node_mtbf_hours=args.mtbf_hours,
        spot_fraction=args.spot_fraction, spot_price=args.spot_price, ondemand_price=args.ondemand_price,
        preemptions_per_hour=args.preemptions_per_hour, notice_s=args.notice_s, restart_s=args.restart_s,
        train_tokens=args.train_tokens)
    plan = {**build_plan(shape, inputs), "verdict": fit_verdict(shape, inputs)}
    print(format_plan(plan))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(_finite(plan), indent=2) + "\n", encoding="utf-8")
        print(f"plan written to {args.json_out}")
    return EXIT_DOES_NOT_FIT if args.check and not plan["verdict"]["fits"] else 0
