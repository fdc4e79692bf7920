"""GRPO throughput and peak memory: ``posttrain grpo`` against TRL's ``GRPOTrainer`` on CPU.

Same model, same RL prompts (rendered by the model's own chat template; the report checks that both
frameworks see the same prompt token ids), same group size G, max new tokens, temperature 1, same
reward (``posttrain.eval.verifiers`` on each prompt's verifier and answer), β = 0, one rollout and one
AdamW update per step (constant lr, clip 1.0), fp32, transformers generation (no vLLM), same torch
threads. Each run is its own process (peak RSS = its ``ru_maxrss`` from ``os.wait4``, imports
included); the runs take turns one step at a time (``--schedule interleaved``, the default) so other
jobs on a shared machine slow them alike, or run one after the other (``sequential``).

A step is the whole step: sampling G completions per prompt, scoring them, the training forward and
backward and the optimizer step, plus whatever else the framework does per step (logging included).
It is timed from the parent's "go" to the step's end (posttrain: when the loop logs the step; TRL:
``on_step_end``). ``prompts_per_s`` = prompts per step / median step time over the timed steps
(warm-up steps excluded), pooled over repeats. Prints ONE JSON line. Figures: benchmarks/README.md.

Usage: ``python benchmarks/grpo_throughput.py`` (builds the ~5M-parameter benchmark Llama and RL
prompts under ``--work-dir`` on first use), ``--only trl`` for TRL alone, or ``--model DIR --data FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
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

FRAMEWORKS = ("posttrain", "trl")
TARGET_SPEEDUP, TARGET_RSS_RATIO = 3.0, 0.8  # issue 13: >= 3x TRL's prompts/s at <= 0.8x its peak RSS


# ----------------------------------------------------------------------------- inputs


def build_default_inputs(work_dir: Path, n_prompts: int, seed: int = 0) -> tuple[Path, Path]:
    """The benchmark Llama (``_harness.build_bench_model``) and ``n_prompts`` RL prompts from ``posttrain.tasks``.

    Prompts carry their answer and verifier (all three task groups: numeric, exact and ifeval
    verifiers). Cached: an existing model directory and prompt file are reused as they are.
    """
    model_dir, data_path = work_dir / "model", work_dir / f"prompts-{n_prompts}-seed{seed}.jsonl"
    if (model_dir / "config.json").exists() and data_path.exists():
        return model_dir, data_path
    from posttrain.data.io import write_records
    from posttrain.tasks.emit import rl_prompts

    prompts = rl_prompts(n_prompts, seed)
    work_dir.mkdir(parents=True, exist_ok=True)
    write_records(data_path, prompts)
    texts = [m.content for p in prompts for m in p.prompt] + [p.answer for p in prompts if p.answer]
    build_bench_model(model_dir, texts, seed)
    return model_dir, data_path


def sft_warm_start(base_model: Path, work_dir: Path, steps: int, threads: int, seed: int = 0) -> Path:
    """``base_model`` after ``steps`` packed SFT steps (``posttrain sft``, batch 16, lr 1e-3) on task chats.

    A random-init model samples near-uniform tokens: completions run to the length cap but every
    completion of a prompt gets the same verifier score, so every group has zero advantage. A few SFT
    steps teach the answer format: rewards then differ inside groups, and completions end early.
    Cached: an existing export is reused.
    """
    out = work_dir / f"sft-{steps}-seed{seed}"
    if (out / "final" / "config.json").exists():
        return out / "final"
    import subprocess

    from posttrain.data.io import write_records
    from posttrain.tasks.emit import sft_examples

    work_dir.mkdir(parents=True, exist_ok=True)
    chats = work_dir / f"sft-chats-seed{seed + 1}.jsonl"
    write_records(chats, sft_examples(16 * steps, seed + 1))  # a different seed from the RL prompts
    overrides = [f"model.path={base_model}", f"data.train={chats}", f"output_dir={out}", "data.curriculum=none",
                 "data.packing=true", f"train.max_steps={steps}", "train.batch_size=16", "train.lr=1e-3",
                 "train.lr_schedule=constant", "train.warmup_steps=0", f"train.save_every={steps + 1}",
                 "metrics.tensorboard=false", f"train.seed={seed}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, "-m", "posttrain", "sft", "--config", "sft_tiny", *overrides], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return out / "final"


def read_prompts(data_path: str | Path):
    from posttrain.data.io import read_records

    records, _ = read_records(data_path, kind="rl", fmt="auto", on_error="raise")
    return records


def prompt_token_check(model_dir: str | Path, records) -> dict:
    """Prompt lengths, and whether TRL's tokenisation of the prompts equals posttrain's.

    TRL renders conversational prompts with ``apply_chat_template(..., add_generation_prompt=True,
    tokenize=True)`` (``GRPOTrainer._tokenize_prompts``); posttrain with ``posttrain.data.chat.encode_prompt``.
    """
    from posttrain.data.chat import as_message_dicts, encode_prompt
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    ours = [encode_prompt(tokenizer, r.prompt) for r in records]
    theirs = tokenizer.apply_chat_template(
        [as_message_dicts(r.prompt) for r in records], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return {
        "mean_prompt_tokens": round(statistics.fmean(len(ids) for ids in ours), 1),
        "same_prompt_ids": [list(a) for a in ours] == [list(b) for b in theirs],
    }


# ----------------------------------------------------------------------------- children


def trl_reward(reward_function):
    """A TRL reward function that scores with posttrain's own ``RewardFunction`` (``posttrain.rl.rewards``).

    Both frameworks then share the reward code, its config (the recipe's default: the record's own
    verifier, weight 1) and its worker pool. TRL hands each completion's dataset columns to reward
    functions: ``record`` is the prompt's ``RLPrompt`` as JSON; conversational completions arrive as
    ``[{"role": "assistant", "content": text}]``.
    """
    from posttrain.data.records import RLPrompt

    parsed: dict[str, RLPrompt] = {}

    def verifier_reward(completions: list, record: list[str], **_columns) -> list[float]:
        prompts = [parsed.setdefault(line, RLPrompt.model_validate_json(line)) for line in record]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return reward_function.score(prompts, texts).rewards

    return verifier_reward


def step_figures(gate: StepGate, warmup: int, prompts_per_step: int, completion_tokens: list[float]) -> dict:
    """Per-step throughput over the timed steps (``warmup`` onwards).

    ``completion_tokens[i]``: tokens sampled in step ``i`` (all G completions of every prompt).
    """
    times, cpu_times = gate.wall_times(), gate.cpu_times()
    if len(times) != len(completion_tokens) or len(times) <= warmup:
        raise RuntimeError(f"{len(times)} timed steps and {len(completion_tokens)} token counts: not enough timed steps")
    times, cpu_times, tokens = times[warmup:], cpu_times[warmup:], completion_tokens[warmup:]
    median = statistics.median(times)
    return {
        "prompts_per_s": prompts_per_step / median,
        "completion_tokens_per_s": statistics.fmean(tokens) / median,
        "median_step_s": median,
        "steps_timed": len(times),
        "step_times_s": times,
        "step_cpu_s": cpu_times,
        "step_prompts": [prompts_per_step] * len(times),
        "mean_completion_tokens_per_step": statistics.fmean(tokens),
    }


def run_posttrain_child(spec: dict) -> dict:
    """Run ``posttrain grpo`` in this process, one gated step at a time."""
    import torch

    from posttrain.cli import main as cli_main

    torch.set_num_threads(spec["threads"])
    out = Path(spec["out_dir"])
    overrides = {
        "output_dir": str(out),
        "model.path": spec["model"],
        "data.train": spec["data"],
        "train.global_batch_size": spec["prompts_per_step"],  # prompts per step
        "train.batch_size": spec["prompts_per_step"] * spec["group_size"],  # completions per micro-batch, as TRL's
        "train.max_steps": spec["warmup_steps"] + spec["steps"],
        "train.lr": spec["lr"],
        "train.lr_schedule": "constant",
        "train.warmup_steps": 0,
        "train.precision": "fp32",
        "train.seed": 0,
        "rl.group_size": spec["group_size"],
        "rl.max_new_tokens": spec["max_new_tokens"],
        "rl.temperature": spec["temperature"],
        "rl.kl_beta": 0,
        "rl.advantage": "grpo",
        "rl.policy_loss": "clipped",
        "rl.clip_low": 0.2,
        "rl.clip_high": 0.28,
        "rl.aggregation": "token_mean",
        "rl.updates_per_rollout": 1,
        "rl.dynamic_sampling": "false",  # TRL has no equivalent: one draw of prompts per step
        "reward.workers": spec["reward_workers"],
        "metrics.tensorboard": "false",  # TRL runs with report_to="none"
    }
    gate = StepGate(*spec["gate_fds"])
    gate_posttrain_loop(gate)
    code = cli_main(["grpo", "--config", spec["recipe"], *(f"{k}={v}" for k, v in overrides.items())])
    if code != 0:
        raise RuntimeError(f"posttrain grpo exited with {code}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "step_time_s" in s]
    completions = spec["prompts_per_step"] * spec["group_size"]
    tokens = [completions * s["completion_len_mean"] for s in steps]
    figures = step_figures(gate, spec["warmup_steps"], spec["prompts_per_step"], tokens)
    figures["reward_mean"] = [round(s["reward_mean"], 4) for s in steps]
    figures["zero_signal_group_share"] = [round(s["zero_signal_share"], 4) for s in steps]
    return figures


def run_trl_child(spec: dict) -> dict:
    """Run TRL's ``GRPOTrainer`` (transformers generation) on the same prompts, one gated step at a time."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.data.chat import as_message_dicts
    from posttrain.rl.rewards import RewardConfig, RewardFunction

    torch.set_num_threads(spec["threads"])
    records = read_prompts(spec["data"])
    dataset = Dataset.from_dict({
        "prompt": [as_message_dicts(r.prompt) for r in records],
        "record": [r.model_dump_json() for r in records],
    })
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    completions = spec["prompts_per_step"] * spec["group_size"]
    args = GRPOConfig(
        output_dir=spec["out_dir"],
        # TRL counts completions, not prompts: one step = one generation batch of P x G completions,
        # one forward/backward over all of them, one optimizer step.
        per_device_train_batch_size=completions,
        gradient_accumulation_steps=1,
        num_generations=spec["group_size"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        beta=0.0,  # no reference model is loaded
        num_iterations=1,
        epsilon=0.2,  # ratio clipped to [1 - 0.2, 1 + 0.28], as posttrain's clip_low / clip_high
        epsilon_high=0.28,
        loss_type="dapo",  # token mean over the global batch (posttrain: rl.aggregation=token_mean)
        scale_rewards="group",  # (r - mean) / std over the prompt's group: GRPO's advantage
        **trl_trainer_args(spec),
    )
    gate = StepGate(*spec["gate_fds"])

    reward_function = RewardFunction(RewardConfig(workers=spec["reward_workers"]))
    trainer = GRPOTrainer(
        model=model, reward_funcs=[trl_reward(reward_function)], args=args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[gated_callback(gate)],
    )
    with reward_function:
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    tokens = [completions * entry["completions/mean_length"] for entry in logged]
    figures = step_figures(gate, spec["warmup_steps"], spec["prompts_per_step"], tokens)
    figures["reward_mean"] = [round(entry["reward"], 4) for entry in logged]
    figures["zero_signal_group_share"] = [round(entry["frac_reward_zero_std"], 4) for entry in logged]
    return figures


RUNNERS = {"posttrain": run_posttrain_child, "trl": run_trl_child}


# ----------------------------------------------------------------------------- parent


def describe(figures: dict) -> str:
    return (
        f"{figures['prompts_per_s']:.2f} prompts/s, median step {figures['median_step_s']:.3f}s "
        f"(fastest {min(figures['step_times_s']):.3f}s, CPU {statistics.median(figures['step_cpu_s']):.3f}s)"
    )


def combine(runs: list[dict]) -> dict:
    """Pool repeats: median step over every timed step, peak RSS the largest seen."""
    times = [t for r in runs for t in r["step_times_s"]]
    median = statistics.median(times)
    prompts = runs[0]["step_prompts"][0]
    mean_tokens = statistics.fmean(r["mean_completion_tokens_per_step"] for r in runs)
    pooled = {
        "prompts_per_s": round(prompts / median, 3),
        "completion_tokens_per_s": round(mean_tokens / median, 1),
        "median_step_s": round(median, 4),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs), 1),
        "steps_timed": len(times),
        "median_step_cpu_s": round(statistics.median(t for r in runs for t in r["step_cpu_s"]), 4),
        "mean_completion_tokens_per_step": round(mean_tokens, 1),
        "per_repeat_prompts_per_s": [round(r["prompts_per_s"], 3) for r in runs],
        "per_repeat_peak_rss_mb": [round(r["peak_rss_mb"], 1) for r in runs],
        # The run's process plus its reward pool workers, sampled every 50 ms.
        "tree_peak_rss_mb": round(max(r.get("tree_peak_rss_mb", 0.0) for r in runs), 1),
        "mean_reward": round(statistics.fmean(x for r in runs for x in r["reward_mean"]), 4),
    }
    if all("zero_signal_group_share" in r for r in runs):  # groups whose G rewards are all equal
        pooled["zero_signal_group_share"] = round(statistics.fmean(x for r in runs for x in r["zero_signal_group_share"]), 4)
    return pooled


def ratios(pooled: dict, results: dict, schedule: str) -> dict:
    """posttrain over TRL: speed (pooled, per repeat, paired by round) and peak RSS; the issue's targets."""
    ours, theirs = pooled["posttrain"], pooled["trl"]
    per_repeat = [
        round(o["prompts_per_s"] / t["prompts_per_s"], 3)
        for o, t in zip(results["posttrain"], results["trl"], strict=True)
    ]
    figures = {
        "prompts_per_s": round(ours["prompts_per_s"] / theirs["prompts_per_s"], 3),
        "prompts_per_s_per_repeat": per_repeat,
        "peak_rss": round(ours["peak_rss_mb"] / theirs["peak_rss_mb"], 3),
        "tree_peak_rss": round(ours["tree_peak_rss_mb"] / theirs["tree_peak_rss_mb"], 3),
        "step_cpu_s": round(theirs["median_step_cpu_s"] / ours["median_step_cpu_s"], 3),
    }
    if schedule == "interleaved":
        figures["prompts_per_s_paired"] = paired_speed_ratio(results["posttrain"], results["trl"], "step_prompts")
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model directory with a chat template (default: build the ~5M-parameter benchmark Llama)")
    parser.add_argument("--data", help="RL prompts JSONL with answer + verifier (default: posttrain.tasks.emit.rl_prompts)")
    parser.add_argument("--work-dir", default="runs/bench/grpo_throughput", help="cache for the default model/prompts and runs")
    parser.add_argument("--n-prompts", type=int, default=512, help="prompts in the default prompt file")
    parser.add_argument(
        "--sft-steps", type=int, default=0,
        help="SFT the model this many steps before the benchmark (0: the random-init model; see sft_warm_start)",
    )
    parser.add_argument("--recipe", default="grpo_tiny", help="posttrain recipe the overrides apply to")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per step (both frameworks)")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt, G (both frameworks)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="completion length cap (both frameworks)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (both frameworks)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps before timing")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate, constant (both frameworks)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every run")
    parser.add_argument(
        "--wait-policy", choices=("PASSIVE", "ACTIVE"), default="PASSIVE",
        help="OMP_WAIT_POLICY in every run (PASSIVE: posttrain's default, right on shared cores; benchmarks/README.md 'threads')",
    )
    parser.add_argument("--reward-workers", type=int, default=2,
                        help="reward pool processes (posttrain.rl.rewards; the same in both frameworks)")
    parser.add_argument("--only", choices=FRAMEWORKS, help="run one framework (no ratios)")
    parser.add_argument(
        "--schedule", choices=("interleaved", "sequential"), default="interleaved",
        help="interleaved: both runs alive at once, taking turns one step each; sequential: one run at a time",
    )
    parser.add_argument("--repeats", type=int, default=3, help="do everything this many times and pool the steps")
    parser.add_argument("--child", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.spec, RUNNERS, args.child)
    work_dir, model_dir, data_path = bench_inputs(args, lambda work: build_default_inputs(work, args.n_prompts))
    if args.sft_steps:
        model_dir = sft_warm_start(model_dir, work_dir, args.sft_steps, args.threads)
    records = read_prompts(data_path)
    frameworks = [args.only] if args.only else list(FRAMEWORKS)
    spec = {
        "model": str(model_dir), "data": str(data_path), "recipe": args.recipe,
        "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "steps": args.steps,
        "warmup_steps": args.warmup_steps, "lr": args.lr, "threads": args.threads,
        "reward_workers": args.reward_workers,
    }
    # Set before torch loads in each child, the same for both: posttrain's CLI would choose PASSIVE only
    # for itself, and too late (the child imports torch first).
    child_env = {"OMP_WAIT_POLICY": args.wait_policy}
    results: dict[str, list[dict]] = {name: [] for name in frameworks}
    load_at_start = os.getloadavg()[0]
    total_steps = args.warmup_steps + args.steps
    for repeat in range(args.repeats):
        order = frameworks if repeat % 2 == 0 else frameworks[::-1]  # who goes first alternates
        groups = [order] if args.schedule == "interleaved" else [[name] for name in order]
        for group in groups:
            children = [Child(__file__, name, spec, work_dir, f"{name}-r{repeat}", describe, child_env,
                              sample_tree_rss=True) for name in group]
            for name, figures in zip(group, drive(children, total_steps), strict=True):
                results[name].append(figures)
    pooled = {name: combine(runs) for name, runs in results.items()}
    report: dict = {
        "benchmark": "grpo_throughput",
        "model": str(model_dir),
        "model_parameters": count_model_parameters(model_dir),
        "data": str(data_path),
        "sft_warm_start_steps": args.sft_steps,
        "prompts": len(records),
        **prompt_token_check(model_dir, records),
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "warmup_steps": args.warmup_steps,
        "steps": args.steps,
        "repeats": args.repeats,
        "schedule": args.schedule,
        "omp_wait_policy": args.wait_policy,
        "reward_workers": args.reward_workers,
        "frameworks": pooled,
    }
    if len(pooled) == 2:
        report["ratios"] = ratios(pooled, results, args.schedule)
        # Conservative: every repeat must clear the speed target, not only the pooled figure.
        report["target_met"] = (
            min(report["ratios"]["prompts_per_s_per_repeat"]) >= TARGET_SPEEDUP
            and report["ratios"]["peak_rss"] <= TARGET_RSS_RATIO
        )
    report["machine"] = machine(args.threads, load_at_start)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
