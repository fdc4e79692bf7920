"""SFT throughput: posttrain vs TRL's ``SFTTrainer``, plus the activation-checkpointing trade-off.

Same model, same chats, packing, same batch size (packed rows per step), max length and optimizer
(AdamW, constant lr, clip 1.0), fp32 on CPU with the same torch threads. Each run is its own process
(peak RSS = its ``ru_maxrss`` from ``os.wait4``). Both frameworks train on the same token ids and
assistant-only labels (tokenised once by posttrain; TRL gets ``input_ids`` + ``labels`` columns) and
each packs its own way, so throughput counts real (non-pad) tokens only. The runs take turns one
optimizer step at a time (``--schedule interleaved``), so other jobs on a shared machine slow them
alike. A step's time runs from the turn starting to the end of its optimizer step (posttrain: when
the loop logs it; TRL: ``on_step_end``) and so includes everything each framework does per step;
``tokens_per_s`` = mean tokens per timed step / median step time. Prints ONE JSON line.
Figures and reasoning: docs/benchmarks_sft.md and benchmarks/README.md ("SFT throughput").

Usage: ``python benchmarks/sft_throughput.py`` (builds a ~5M-parameter Llama with a 4k vocabulary and
~100-token chats under ``--work-dir`` on first use) or ``--model DIR --data FILE.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

from _harness import (
    Child,
    StepGate,
    bench_inputs,
    build_bench_model,
    child_main,
    count_model_parameters,
    drive,
    gate_posttrain_loop,
    gated_callback,
    machine,
    paired_speed_ratio,
    trl_trainer_args,
)

SYSTEM_PROMPT = "You are a careful assistant. Answer briefly."


# ----------------------------------------------------------------------------- inputs


def build_default_inputs(work_dir: Path, n_chats: int, seed: int = 0) -> tuple[Path, Path]:
    """A ~5M-parameter Llama (hidden 256, 4 layers, 4 heads, MLP 688, vocab 4096) and ~100-token chats.

    Chats string 2-6 single-turn task problems (``posttrain.tasks``) into one conversation after a
    system prompt. Cached: an existing model directory and data file are reused as they are.
    """
    model_dir, data_path = work_dir / "model", work_dir / f"chats-{n_chats}-seed{seed}.jsonl"
    if (model_dir / "config.json").exists() and data_path.exists():
        return model_dir, data_path
    from posttrain.data.io import write_records
    from posttrain.data.records import Message, SFTExample
    from posttrain.tasks.emit import sft_examples

    rng = random.Random(seed)
    singles = sft_examples(n_chats * 6, seed, unique=False)  # chats need more problems than some families hold
    chats, cursor = [], 0
    while len(chats) < n_chats:
        turns = singles[cursor : cursor + rng.randint(2, 6)]
        cursor += len(turns)
        messages = [Message(role="system", content=SYSTEM_PROMPT)] + [m for t in turns for m in t.messages]
        chats.append(SFTExample(id=f"bench-{seed}-{len(chats):05d}", messages=messages, tier=max(t.tier for t in turns)))
    work_dir.mkdir(parents=True, exist_ok=True)
    write_records(data_path, chats)
    build_bench_model(model_dir, [m.content for c in chats for m in c.messages], seed)
    return model_dir, data_path


def tokenized_chats(model_dir: str, data_path: str, max_length: int):
    """Chats tokenised by posttrain (assistant-only labels), in file order — what both frameworks train on."""
    from posttrain.data.io import read_records
    from posttrain.data.tokenize import tokenize_chat
    from posttrain.models.load import load_tokenizer
    from posttrain.train.sft import loss_tokens

    tokenizer = load_tokenizer(model_dir)
    records, _ = read_records(data_path, kind="sft", fmt="auto", on_error="raise")
    examples = [tokenize_chat(r, tokenizer, max_length, "right") for r in records]
    return [e for e in examples if loss_tokens(e.labels) > 0], tokenizer


# ----------------------------------------------------------------------------- children


def _step_figures(gate: StepGate, tokens: list[int], loss_tokens: list[int], warmup: int) -> dict:
    """Throughput over the timed steps (``warmup`` onwards)."""
    spans = gate.spans
    if len(spans) != len(tokens) or len(spans) <= warmup:
        raise RuntimeError(f"{len(spans)} timed spans and {len(tokens)} token counts: not enough timed steps")
    timed = range(warmup, len(spans))
    times = [spans[i][1][0] - spans[i][0][0] for i in timed]
    cpu_times = [spans[i][1][1] - spans[i][0][1] for i in timed]
    median = statistics.median(times)
    mean_tokens = statistics.fmean(tokens[i] for i in timed)
    mean_loss_tokens = statistics.fmean(loss_tokens[i] for i in timed)
    return {
        "tokens_per_s": mean_tokens / median,
        "loss_tokens_per_s": mean_loss_tokens / median,
        "median_step_s": median,
        "mean_tokens_per_step": mean_tokens,
        "mean_loss_tokens_per_step": mean_loss_tokens,
        "steps_timed": len(times),
        "step_times_s": times,
        "step_cpu_s": cpu_times,
        "step_tokens": [tokens[i] for i in timed],
    }


def run_posttrain_child(spec: dict) -> dict:
    """Run ``posttrain sft`` in this process, one gated step at a time."""
    import torch
    import yaml

    from posttrain.cli import main as cli_main

    torch.set_num_threads(spec["threads"])
    out = Path(spec["out_dir"])
    config = {
        "recipe": "sft",
        "output_dir": str(out),
        "model": {"path": spec["model"], "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"train": spec["data"], "packing": True, "curriculum": "none", "shuffle": True},
        "train": {
            "batch_size": spec["batch_size"],
            "global_batch_size": spec["batch_size"],
            "max_length": spec["max_length"],
            "max_steps": spec["warmup_steps"] + spec["steps"],
            "lr": spec["lr"],
            "lr_schedule": "constant",
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "betas": [0.9, 0.999],
            "max_grad_norm": 1.0,
            "precision": "fp32",
            "fsdp": "off",
            "activation_checkpointing": spec["ac"],
            "seed": 0,
        },
        "metrics": {"tensorboard": False},  # TRL runs with report_to="none"
    }
    if spec.get("lora"):  # benchmarks/lora_throughput.py: the same adapters as TRL's peft_config
        config["model"]["lora"] = spec["lora"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.yaml").write_text(yaml.safe_dump(config))
    gate = StepGate(*spec["gate_fds"])
    gate_posttrain_loop(gate)
    code = cli_main(["sft", "--config", str(out / "bench.yaml")])
    if code != 0:
        raise RuntimeError(f"posttrain sft exited with {code}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "tokens_per_s" in s]
    tokens = [round(s["tokens_per_s"] * s["step_time_s"]) for s in steps]
    loss_tokens = [round(s["loss_tokens_per_s"] * s["step_time_s"]) for s in steps]
    figures = _step_figures(gate, tokens, loss_tokens, spec["warmup_steps"])
    figures["final_loss"] = steps[-1]["loss"]
    return figures


def run_trl_child(spec: dict) -> dict:
    """Run TRL's ``SFTTrainer`` with packing on the pre-tokenised chats, one gated step at a time."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(spec["threads"])
    examples, tokenizer = tokenized_chats(spec["model"], spec["data"], spec["max_length"])
    dataset = Dataset.from_dict({"input_ids": [e.input_ids for e in examples], "labels": [e.labels for e in examples]})
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    args = SFTConfig(
        output_dir=spec["out_dir"],
        packing=True,  # packing_strategy "bfd" (the default) turns on padding-free batches
        max_length=spec["max_length"],
        per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1,
        **trl_trainer_args(spec),
    )
    gate = StepGate(*spec["gate_fds"])

    peft_config = None
    if spec.get("lora"):  # benchmarks/lora_throughput.py: the same adapters as posttrain's model.lora
        from peft import LoraConfig

        lora = spec["lora"]
        peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                 target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[gated_callback(gate)],
                         peft_config=peft_config)
    tokens: list[int] = []
    loss_tokens: list[int] = []
    collate = trainer.data_collator

    def counting_collator(features):
        batch = collate(features)
        mask = batch.get("attention_mask")
        tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        loss_tokens.append(int((batch["labels"][:, 1:] != -100).sum()))
        return batch

    trainer.data_collator = counting_collator
    result = trainer.train()
    # One collated batch per optimizer step (grad_accum 1, no workers, no eval).
    steps = len(gate.spans)
    figures = _step_figures(gate, tokens[:steps], loss_tokens[:steps], spec["warmup_steps"])
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    figures["final_loss"] = float(logged[-1]) if logged else float(result.training_loss)
    figures["packed_rows"] = len(trainer.train_dataset)
    return figures


# ----------------------------------------------------------------------------- parent


def describe_figures(figures: dict) -> str:
    return (
        f"{figures['tokens_per_s']:.0f} tok/s, median step {figures['median_step_s']:.3f}s "
        f"(fastest {min(figures['step_times_s']):.3f}s, CPU {statistics.median(figures['step_cpu_s']):.3f}s)"
    )


def combine(runs: list[dict]) -> dict:
    """Pool repeats: median step over every timed step, peak RSS the largest seen."""
    times = [t for r in runs for t in r["step_times_s"]]
    median = statistics.median(times)
    cpu_median = statistics.median(t for r in runs for t in r["step_cpu_s"])
    mean_tokens = statistics.fmean(r["mean_tokens_per_step"] for r in runs)
    mean_loss_tokens = statistics.fmean(r["mean_loss_tokens_per_step"] for r in runs)
    return {
        "tokens_per_s": round(mean_tokens / median, 1),
        "loss_tokens_per_s": round(mean_loss_tokens / median, 1),
        "median_step_s": round(median, 4),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs), 1),
        "steps_timed": len(times),
        "median_step_cpu_s": round(cpu_median, 4),
        "mean_tokens_per_step": round(mean_tokens, 1),
        "mean_loss_tokens_per_step": round(mean_loss_tokens, 1),
        "per_repeat_tokens_per_s": [round(r["tokens_per_s"], 1) for r in runs],
        "final_loss": [round(r["final_loss"], 4) for r in runs],
    }


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The SFT run's sizes, shared with ``lora_throughput.py`` (its runs are this script's children)."""
    parser.add_argument("--chats", type=int, default=2000, help="chats in the default data set")
    parser.add_argument("--batch-size", type=int, default=8, help="packed rows per step (every run)")
    parser.add_argument("--max-length", type=int, default=512, help="packed row length (every run)")
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed optimizer steps before timing")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, constant (every run)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every run")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model directory (default: build a ~5M-parameter Llama, 4k vocab)")
    parser.add_argument("--data", help="SFT JSONL (default: ~100-token chats from posttrain.tasks)")
    parser.add_argument("--work-dir", default="runs/bench/sft_throughput", help="cache for the default model/data and runs")
    add_run_arguments(parser)
    parser.add_argument("--frameworks", default="posttrain,trl", help="comma list of posttrain, trl")
    parser.add_argument(
        "--ac", default="none,full,selective",
        help="posttrain activation_checkpointing modes for the AC table, one run each ('' for no table)",
    )
    parser.add_argument(
        "--schedule", choices=("interleaved", "sequential"), default="interleaved",
        help="interleaved: all runs alive at once, taking turns one optimizer step each; sequential: one run at a time",
    )
    parser.add_argument("--repeats", type=int, default=1, help="do everything this many times and pool the steps")
    parser.add_argument("--child", choices=("posttrain", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.spec, {"posttrain": run_posttrain_child, "trl": run_trl_child}, args.child)
    frameworks = [f for f in args.frameworks.split(",") if f]
    ac_modes = [m for m in args.ac.split(",") if m]
    for name in frameworks:
        if name not in ("posttrain", "trl"):
            raise SystemExit(f"--frameworks: unknown framework {name!r}; choose from posttrain, trl")
    for mode in ac_modes:
        if mode not in ("none", "full", "selective"):
            raise SystemExit(f"--ac: unknown mode {mode!r}; choose from none, full, selective")
    work_dir, model_dir, data_path = bench_inputs(args, lambda work: build_default_inputs(work, args.chats))
    examples, _ = tokenized_chats(str(model_dir), str(data_path), args.max_length)
    spec = {
        "model": str(model_dir), "data": str(data_path), "batch_size": args.batch_size, "max_length": args.max_length,
        "steps": args.steps, "warmup_steps": args.warmup_steps, "lr": args.lr, "threads": args.threads, "ac": "none",
    }
    # posttrain with AC "none" is the framework comparison's posttrain run; other modes are extra runs.
    plan = [("trl", "none")] if "trl" in frameworks else []
    if "posttrain" in frameworks or ac_modes:
        plan += [("posttrain", mode) for mode in dict.fromkeys(["none", *ac_modes])]
    results: dict[tuple[str, str], list[dict]] = {key: [] for key in plan}
    load_at_start = os.getloadavg()[0]
    total_steps = args.warmup_steps + args.steps
    for repeat in range(args.repeats):
        if args.schedule == "interleaved":
            groups = [plan]
        else:  # one at a time, alternating the order between repeats
            groups = [[key] for key in (plan if repeat % 2 == 0 else plan[::-1])]
        for group in groups:
            children = [Child(__file__, f, {**spec, "ac": mode}, work_dir, f"{f}-ac_{mode}-r{repeat}", describe_figures)
                        for f, mode in group]
            for (framework, mode), figures in zip(group, drive(children, total_steps), strict=True):
                results[(framework, mode)].append(figures)
    pooled = {key: combine(runs) for key, runs in results.items()}
    report: dict = {
        "benchmark": "sft_throughput",
        "model": str(model_dir),
        "model_parameters": count_model_parameters(model_dir),
        "data": str(data_path),
        "examples": len(examples),
        "mean_example_tokens": round(statistics.fmean(len(e.input_ids) for e in examples), 1),
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "warmup_steps": args.warmup_steps,
        "repeats": args.repeats,
        "schedule": args.schedule,
        "frameworks": {},
    }
    if ("posttrain", "none") in pooled and "posttrain" in frameworks:
        report["frameworks"]["posttrain"] = pooled[("posttrain", "none")]
    if ("trl", "none") in pooled:
        report["frameworks"]["trl"] = pooled[("trl", "none")]
    if {"posttrain", "trl"} <= report["frameworks"].keys():
        ours, theirs = report["frameworks"]["posttrain"], report["frameworks"]["trl"]
        ours_runs, theirs_runs = results[("posttrain", "none")], results[("trl", "none")]
        per_repeat = [round(o["tokens_per_s"] / t["tokens_per_s"], 3) for o, t in zip(ours_runs, theirs_runs, strict=True)]
        report["ratios"] = {
            "tokens_per_s": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
            "tokens_per_s_per_repeat": per_repeat,
            "loss_tokens_per_s": round(ours["loss_tokens_per_s"] / theirs["loss_tokens_per_s"], 3),
            "peak_rss": round(ours["peak_rss_mb"] / theirs["peak_rss_mb"], 3),
            "step_cpu_s": round(theirs["median_step_cpu_s"] / ours["median_step_cpu_s"], 3),
        }
        if args.schedule == "interleaved":
            report["ratios"]["tokens_per_s_paired"] = paired_speed_ratio(ours_runs, theirs_runs, "step_tokens")
        # Conservative: every repeat must clear 1.5x, not only the pooled figure.
        report["target_met"] = min(per_repeat) >= 1.5 and report["ratios"]["peak_rss"] <= 1.0
    if ac_modes:
        base = pooled[("posttrain", "none")]
        table = {}
        for mode in dict.fromkeys(["none", *ac_modes]):
            figures = pooled[("posttrain", mode)]
            # Interleaved, each round compares the modes under the same load (see paired_speed_ratio);
            # pooled medians of runs that met different loads can mislead.
            speed = (
                paired_speed_ratio(results[("posttrain", mode)], results[("posttrain", "none")], "step_tokens")
                if args.schedule == "interleaved"
                else round(figures["tokens_per_s"] / base["tokens_per_s"], 3)
            )
            table[mode] = {
                "speed_vs_none": speed,
                "peak_rss_mb": figures["peak_rss_mb"],
                "peak_rss_saved_mb": round(base["peak_rss_mb"] - figures["peak_rss_mb"], 1),
                "tokens_per_s": figures["tokens_per_s"],
                "per_repeat_tokens_per_s": figures["per_repeat_tokens_per_s"],
                "median_step_s": figures["median_step_s"],
                "median_step_cpu_s": figures["median_step_cpu_s"],
            }
        report["activation_checkpointing"] = table
    report["machine"] = machine(args.threads, load_at_start)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
