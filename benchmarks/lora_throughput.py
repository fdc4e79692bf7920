"""LoRA SFT throughput and memory: posttrain LoRA vs posttrain full fine-tuning vs TRL's ``SFTTrainer`` with
the same peft config.

The harness is ``benchmarks/sft_throughput.py``'s (one process per run, the runs taking turns one optimizer
step at a time, peak RSS from ``os.wait4``, the same token ids and assistant-only labels, packing, AdamW
with a constant lr, fp32 on CPU); its children read ``spec["lora"]`` — posttrain as ``model.lora``, TRL as
``peft_config=LoraConfig(...)`` with the same r, alpha, dropout and target modules. Three runs per round:
``posttrain_full``, ``posttrain_lora``, ``trl_lora``. Prints ONE JSON line; figures in benchmarks/README.md
("lora_throughput").

Usage: ``python benchmarks/lora_throughput.py`` (the default ~5M-parameter model and chats of
sft_throughput, built under ``--work-dir`` on first use) or ``--model DIR --data FILE.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Child, bench_inputs, count_model_parameters, drive, machine, paired_speed_ratio  # noqa: E402
from sft_throughput import add_run_arguments, build_default_inputs, combine, describe_figures, tokenized_chats  # noqa: E402 - the SFT children

RUNS = {"posttrain_full": ("posttrain", False), "posttrain_lora": ("posttrain", True), "trl_lora": ("trl", True)}


def trainable_parameters(model_dir: Path, lora: dict) -> int:
    """Adapter parameters for ``lora`` on this model (peft's count, as both frameworks train them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.config.sections import LoraConfig
    from posttrain.models.lora import apply_lora, parameter_counts

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return parameter_counts(apply_lora(model, LoraConfig(**lora)))[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model directory (default: sft_throughput's ~5M-parameter Llama)")
    parser.add_argument("--data", help="SFT JSONL (default: sft_throughput's ~100-token chats)")
    parser.add_argument("--work-dir", default="runs/bench/lora_throughput", help="cache for inputs and runs")
    add_run_arguments(parser)
    parser.add_argument("--rank", type=int, default=16, help="LoRA r")
    parser.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha")
    parser.add_argument("--target-modules", default="all-linear", help="all-linear or a comma list (q_proj,v_proj)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    parser.add_argument("--repeats", type=int, default=1, help="rounds; steps are pooled over them")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [name for name in args.runs.split(",") if name]
    unknown = set(names) - RUNS.keys()
    if unknown:
        raise SystemExit(f"--runs: unknown {sorted(unknown)}; choose from {', '.join(RUNS)}")
    work_dir, model_dir, data_path = bench_inputs(args, lambda work: build_default_inputs(work, args.chats))
    examples, _ = tokenized_chats(str(model_dir), str(data_path), args.max_length)
    targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
    lora = {"r": args.rank, "alpha": args.alpha, "dropout": 0.0, "target_modules": targets}
    spec = {
        "model": str(model_dir), "data": str(data_path), "batch_size": args.batch_size, "max_length": args.max_length,
        "steps": args.steps, "warmup_steps": args.warmup_steps, "lr": args.lr, "threads": args.threads, "ac": "none",
    }
    results: dict[str, list[dict]] = {name: [] for name in names}
    load_at_start = os.getloadavg()[0]
    for repeat in range(args.repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        sft_script = Path(__file__).resolve().parent / "sft_throughput.py"  # its children run both frameworks
        children = [Child(sft_script, RUNS[name][0], {**spec, "lora": lora if RUNS[name][1] else None}, work_dir,
                          f"{name}-r{repeat}", describe_figures) for name in order]
        for name, figures in zip(order, drive(children, args.warmup_steps + args.steps), strict=True):
            results[name].append(figures)
    pooled = {name: combine(runs) for name, runs in results.items()}
    report: dict = {
        "benchmark": "lora_throughput",
        "model": str(model_dir),
        "model_parameters": count_model_parameters(model_dir),
        "lora": lora,
        "lora_trainable_parameters": trainable_parameters(model_dir, lora),
        "examples": len(examples),
        "mean_example_tokens": round(statistics.fmean(len(e.input_ids) for e in examples), 1),
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "warmup_steps": args.warmup_steps,
        "repeats": args.repeats,
        "runs": pooled,
        "ratios": {},
    }

    def compare(ours: str, theirs: str) -> dict:
        return {
            "tokens_per_s": round(pooled[ours]["tokens_per_s"] / pooled[theirs]["tokens_per_s"], 3),
            "tokens_per_s_paired": paired_speed_ratio(results[ours], results[theirs], "step_tokens"),
            "peak_rss": round(pooled[ours]["peak_rss_mb"] / pooled[theirs]["peak_rss_mb"], 3),
        }

    if {"posttrain_lora", "posttrain_full"} <= pooled.keys():
        report["ratios"]["lora_over_full"] = compare("posttrain_lora", "posttrain_full")
    if {"posttrain_lora", "trl_lora"} <= pooled.keys():
        report["ratios"]["posttrain_lora_over_trl_lora"] = ratio = compare("posttrain_lora", "trl_lora")
        report["target_met"] = ratio["tokens_per_s_paired"] > 1.0 and ratio["peak_rss"] < 1.0
    report["machine"] = machine(args.threads, load_at_start)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
