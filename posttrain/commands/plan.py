"""``posttrain plan``: memory per GPU, communication, step time, checkpoint interval, goodput and cost on paper.

The formulas and their sources are in posttrain/plan/ and docs/plan.md. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="Plan a run on paper: memory per GPU, FSDP traffic, step time, checkpoint interval, goodput.",
        description="Estimate a ZeRO-3/FSDP2 run's memory per GPU, communication, step time, Young/Daly checkpoint "
                    "interval, goodput and cost for a spot/on-demand mix. Formulas and validation: docs/plan.md.")
    parser.add_argument("--model", required=True,
                        help="preset (llama3-8b, llama3-70b, llama3-405b, dense-1t) or an HF config.json path")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs sharding the model (FSDP world size)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
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
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (sft, dpo)")
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
    parser.add_argument("--prompt-len", type=int, default=512, help="grpo: prompt tokens")
    parser.add_argument("--completion-len", type=int, default=1024, help="grpo: completion tokens")
    parser.add_argument("--rollout-batch", type=int, default=8, help="grpo: sequences generated at once per GPU")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU peak (H100 SXM bf16 dense: 989)")
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
    parser.add_argument("--json", dest="json_out", help="write the plan as JSON to this file")
    parser.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    from posttrain.config.loader import ConfigError

    problems = []
    for name in ("gpus", "gpus_per_node", "seq", "micro_batch", "prompt_len", "completion_len", "rollout_batch"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 < args.mfu <= 1:
        problems.append("--mfu must be in (0, 1]")
    if not 0 <= args.spot_fraction <= 1:
        problems.append("--spot-fraction must be in [0, 1]")
    for name in ("peak_tflops", "bandwidth_gbps", "store_gbps", "train_tokens"):
        if getattr(args, name) <= 0:
            problems.append(f"--{name.replace('_', '-')} must be positive")
    if problems:
        raise ConfigError(["; ".join(problems)])


def _finite(value):
    """JSON has no infinity: an interval that is never needed (nothing fails) is written as null."""
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, float) and math.isinf(value):
        return None
    return value


def run(args: argparse.Namespace) -> int:
    from posttrain.plan.report import PlanInputs, build_plan, format_plan
    from posttrain.plan.shapes import load_shape

    _check(args)
    shape = load_shape(args.model)
    inputs = PlanInputs(
        gpus=args.gpus, gpus_per_node=args.gpus_per_node, recipe=args.recipe, offload=args.offload, ac=args.ac,
        seq=args.seq, micro_batch=args.micro_batch, precision=args.precision, flash=args.flash,
        layers=args.layers, padded=args.padded, reference=args.reference,
        loss_chunk=args.loss_chunk or None, prompt_len=args.prompt_len, completion_len=args.completion_len,
        rollout_batch=args.rollout_batch, mfu=args.mfu, peak_tflops=args.peak_tflops,
        bandwidth_gbps=args.bandwidth_gbps, store_gbps=args.store_gbps, node_mtbf_hours=args.mtbf_hours,
        spot_fraction=args.spot_fraction, spot_price=args.spot_price, ondemand_price=args.ondemand_price,
        preemptions_per_hour=args.preemptions_per_hour, notice_s=args.notice_s, restart_s=args.restart_s,
        train_tokens=args.train_tokens)
    plan = build_plan(shape, inputs)
    print(format_plan(plan))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(_finite(plan), indent=2) + "\n", encoding="utf-8")
        print(f"plan written to {args.json_out}")
    return 0
