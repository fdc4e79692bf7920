"""Does tool-using GRPO raise the tool-call rate and the held-out reward on the built-in ``tool_use`` task?

A random tiny model never writes ``<python>``, so RL alone has nothing to raise (docs/agentic.md). This script
measures the rise from a warm start, all with posttrain's own pieces, in one process:

1. **Model**: ``build_tiny_model`` (posttrain's tiny-model factory), its BPE tokenizer trained on the task's
   transcripts (digits stay one token each), seeded.
2. **Warm start (SFT)**: ``posttrain sft`` (``run_sft``, recipe ``sft_tiny`` with overrides) on
   ``tool_transcripts``: a ``--tool-share`` of them call the tool (system instructions, question,
   ``<python>print(...)</python>``, a ``tool`` turn with what it prints, the answer), the rest answer at once.
   They tokenise to exactly the episodes a correct policy has (tests/rl/test_tool_transcripts.py). A tiny
   model's direct answer to these problems is almost always wrong, so the reward favours the call, and with a
   share below 1 the warm start calls it only sometimes: room for RL.
3. **Before**: one greedy episode per held-out prompt (the eval split, never trained on) with the real
   ``python_tool`` environment and sandbox — ``EpisodeRollouts.evaluate``, scored by the recipe's reward with
   ``episode_reward``: what ``posttrain grpo`` logs as ``eval/*``.
4. **GRPO**: ``posttrain grpo`` (``run_grpo``, recipe ``grpo_tools_tiny``) from the SFT export on train-split
   prompts, ``data.eval`` = the held-out prompts (its logged final ``eval/reward`` is reported beside ours as a
   cross-check: the same episodes, so the same number).
5. **After**: the held-out episodes again on the GRPO export; before vs after by posttrain's paired sign-flip
   test (``posttrain.eval.stats.compare_results``: paired by item id and content, two-sided p and the test's
   own 95% interval, in points), for the reward and for the tool-call indicator.

Prints ONE JSON line (sizes, steps, seeds, wall times, the figures). Needs bubblewrap (the tool's sandbox).
Usage: ``python benchmarks/tool_rl_rise.py [--work-dir DIR]``; figures in benchmarks/README.md and docs/agentic.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", help="where the model, data and runs go (default: a temporary directory)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="model init, data and training seed")
    parser.add_argument("--tiers", default="1", help="tool_use tiers, comma-separated (default 1: multiply_large)")
    # model
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    # warm start
    parser.add_argument("--sft-examples", type=int, default=12000)
    parser.add_argument("--tool-share", type=float, default=0.45,
                        help="share of SFT transcripts that call the tool (below 1/2: greedy decoding answers directly)")
    parser.add_argument("--sft-steps", type=int, default=450)
    parser.add_argument("--sft-batch", type=int, default=32, help="packed rows of 256 tokens per step")
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    # GRPO
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--grpo-lr", type=float, default=2e-4)
    parser.add_argument("--rl-prompts", type=int, default=512, help="train-split RL prompts to draw from")
    # evaluation
    parser.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts (eval split)")
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace, work: Path) -> dict:
    """The model, the SFT transcripts, the RL prompts and the held-out prompts under ``work``."""
    from posttrain.data.io import write_records
    from posttrain.models.tiny import build_tiny_model
    from posttrain.rl.tools import TOOL_FORMATS
    from posttrain.tasks.emit import rl_prompts
    from posttrain.tasks.tool_use import tool_transcripts

    tiers = [int(t) for t in args.tiers.split(",")]
    instructions = TOOL_FORMATS.get("plain")().instructions
    transcripts = tool_transcripts(args.sft_examples, args.seed, instructions, args.tool_share, tiers=tiers)
    texts = [m.content for t in transcripts[:2000] for m in t.messages]
    model = build_tiny_model(work / "base", texts=texts, vocab_size=args.vocab, hidden_size=args.hidden,
                             num_layers=args.layers, num_heads=args.heads, num_kv_heads=max(1, args.heads // 2),
                             seed=args.seed)
    paths = {"model": model, "sft": work / "sft.jsonl", "rl": work / "rl.jsonl", "eval": work / "eval.jsonl"}
    write_records(str(paths["sft"]), transcripts)
    write_records(str(paths["rl"]), rl_prompts(args.rl_prompts, args.seed, groups=["tool_use"], tiers=tiers))
    held_out = rl_prompts(args.eval_prompts, args.seed, split="eval", unique=True, groups=["tool_use"], tiers=tiers)
    write_records(str(paths["eval"]), held_out)
    return {**paths, "held_out": held_out,
            "transcripts_with_tool": sum(t.meta["tool_call"] for t in transcripts)}


def sft_overrides(args: argparse.Namespace, paths: dict, out: Path) -> list[str]:
    settings = {"model.path": paths["model"], "data.train": paths["sft"], "output_dir": out,
                "data.curriculum": "none", "data.packing": "true", "train.max_steps": args.sft_steps, "train.batch_size": args.sft_batch,
                "train.max_length": 256, "train.lr": args.sft_lr, "train.lr_schedule": "cosine",
                "train.warmup_steps": max(1, args.sft_steps // 20), "train.min_lr_ratio": 0.1,
                "train.save_every": "null", "train.seed": args.seed, "metrics.tensorboard": "false"}
    return [f"{key}={value}" for key, value in settings.items()]


def grpo_overrides(args: argparse.Namespace, paths: dict, model: Path, out: Path) -> list[str]:
    episodes = args.prompts_per_step * args.group_size
    settings = {"model.path": model, "data.train": paths["rl"], "data.eval": paths["eval"], "output_dir": out,
                "train.max_steps": args.grpo_steps, "train.global_batch_size": args.prompts_per_step,
                "train.batch_size": episodes, "train.lr": args.grpo_lr, "train.save_every": "null",
                "train.seed": args.seed, "rl.group_size": args.group_size, "rl.rollout_batch_size": episodes,
                "reward.workers": 0, "metrics.tensorboard": "false"}
    return [f"{key}={value}" for key, value in settings.items()]


def held_out_episodes(model_dir: Path, recipe, prompts: list) -> list[dict]:
    """One greedy episode per held-out prompt on ``model_dir``'s weights, as ``posttrain grpo`` evaluates
    ``data.eval`` (``reward_evaluator``): ``EpisodeRollouts.evaluate``, the recipe's reward, ``episode_reward``.
    One row per prompt in ``posttrain eval``'s result shape (id, content hash, group, tier, score)."""
    from collections import Counter

    from posttrain.eval.items import content_hash
    from posttrain.generate.engine import SamplingParams
    from posttrain.models.load import load_model, load_tokenizer
    from posttrain.rl.multiturn import EpisodeRollouts, episode_reward
    from posttrain.rl.rewards import RewardFunction

    tokenizer = load_tokenizer(str(model_dir))
    model = load_model(str(model_dir))
    params = SamplingParams(n=recipe.rl.group_size, temperature=recipe.rl.temperature,
                            max_new_tokens=recipe.rl.max_new_tokens, logprobs=True)
    episodes = EpisodeRollouts(model, model, tokenizer, recipe.env, params, recipe.rl.rollout_batch_size,
                               recipe.train.max_length)
    rollouts = episodes.evaluate(prompts)
    with RewardFunction(recipe.reward) as rewards:
        scored = rewards.score(prompts, [r.text for r in rollouts])
    rows, counters = [], Counter()
    for prompt, rollout, value, passed in zip(prompts, rollouts, scored.rewards, scored.passed, strict=True):
        reward, _ = episode_reward(rollout, value, passed, counters)
        info = rollout.episode or {}
        rows.append({"id": prompt.id, "group": prompt.group, "tier": prompt.tier, "score": float(reward),
                     "content_hash": content_hash(prompt.prompt, prompt.answer, verifier=prompt.verifier),
                     "tool_call": float(info.get("tool_calls", 0) > 0), "tool_errors": int(info.get("tool_errors", 0)),
                     "text": rollout.text})
    return rows


def paired(before: list[dict], after: list[dict], key: str, seed: int) -> dict:
    """posttrain's paired sign-flip test of ``after`` against ``before`` on ``key`` (0/1 per item): the composite
    block of ``compare_results`` (one group, so it is the plain mean difference), in points."""
    from posttrain.eval.stats import compare_results

    def as_result(rows: list[dict]) -> dict:
        return {"items": [{**{k: row[k] for k in ("id", "group", "tier", "content_hash")}, "score": row[key]}
                          for row in rows]}

    block = compare_results(as_result(before), as_result(after), seed=seed)["composite"]
    return {name: block[name] for name in ("base", "new", "delta", "ci_low", "ci_high", "confidence", "p_value",
                                           "significant", "exact", "n", "n_changed")}


def rate(rows: list[dict], key: str) -> float:
    return sum(row[key] for row in rows) / len(rows)


def logged_eval(run_dir: Path) -> dict:
    """The last ``eval/*`` record the GRPO run wrote to metrics.jsonl (its end-of-run held-out evaluation)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    return {k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {}


def train_figures(run_dir: Path, keys: tuple[str, ...]) -> list[dict]:
    """Per-step training figures of a run (metrics.jsonl), only ``keys``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: r[k] for k in keys if k in r} for r in records if "eval/reward" not in r and any(k in r for k in keys)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    from posttrain.threads import configure_threads

    threads = configure_threads(args.threads).threads  # before torch loads (OMP_NUM_THREADS, passive waits)
    import torch

    torch.set_num_threads(threads)
    from posttrain.config.loader import load_config
    from posttrain.config.recipes import SFTRecipe
    from posttrain.config.rl import GRPORecipe
    from posttrain.eval.sandbox import sandbox_support
    from posttrain.models.tiny import count_parameters
    from posttrain.train.grpo import run_grpo
    from posttrain.train.sft import run_sft

    supported, why = sandbox_support()
    if not supported:
        print(f"tool_rl_rise: the python tool's sandbox is unavailable here ({why}); install bubblewrap",
              file=sys.stderr)
        return 2
    temporary = None if args.work_dir else tempfile.TemporaryDirectory(prefix="tool-rl-rise-")
    work = Path(args.work_dir or temporary.name)
    work.mkdir(parents=True, exist_ok=True)
    walls: dict[str, float] = {}

    def timed(name: str, fn, *a):
        t0 = time.perf_counter()
        value = fn(*a)
        walls[name] = round(time.perf_counter() - t0, 2)
        return value

    try:
        paths = timed("prepare_s", prepare, args, work)
        sft = load_config(SFTRecipe, "sft_tiny", sft_overrides(args, paths, work / "sft-run"))
        if timed("sft_s", run_sft, sft) != 0:
            raise RuntimeError("the SFT run failed")
        warm = work / "sft-run" / "final"
        grpo = load_config(GRPORecipe, "grpo_tools_tiny", grpo_overrides(args, paths, warm, work / "grpo-run"))
        before = timed("eval_before_s", held_out_episodes, warm, grpo, paths["held_out"])
        if timed("grpo_s", run_grpo, grpo) != 0:
            raise RuntimeError("the GRPO run failed")
        after = timed("eval_after_s", held_out_episodes, work / "grpo-run" / "final", grpo, paths["held_out"])
        from transformers import AutoModelForCausalLM

        parameters = count_parameters(AutoModelForCausalLM.from_pretrained(str(warm)))
        steps = train_figures(work / "grpo-run", ("reward_mean", "episode/tool_call_rate"))
        sft_loss = train_figures(work / "sft-run", ("loss",))
        result = {
            "benchmark": "tool_rl_rise",
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": threads,
                        "torch": torch.__version__},
            "seed": args.seed, "tiers": [int(t) for t in args.tiers.split(",")],
            "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "vocab": args.vocab,
                      "parameters": parameters},
            "sft": {"examples": args.sft_examples, "with_tool": paths["transcripts_with_tool"],
                    "tool_share": args.tool_share, "steps": args.sft_steps, "batch": args.sft_batch,
                    "lr": args.sft_lr, "loss_first": sft_loss[0].get("loss") if sft_loss else None,
                    "loss_last": sft_loss[-1].get("loss") if sft_loss else None},
            "grpo": {"steps": args.grpo_steps, "prompts_per_step": args.prompts_per_step,
                     "group_size": args.group_size, "lr": args.grpo_lr, "rl_prompts": args.rl_prompts,
                     "episodes": args.grpo_steps * args.prompts_per_step * args.group_size,
                     "train_reward_first": steps[0].get("reward_mean") if steps else None,
                     "train_reward_last": steps[-1].get("reward_mean") if steps else None,
                     "train_tool_call_rate_first": steps[0].get("episode/tool_call_rate") if steps else None,
                     "train_tool_call_rate_last": steps[-1].get("episode/tool_call_rate") if steps else None},
            "held_out": {"prompts": len(before),
                         "reward_before": rate(before, "score"), "reward_after": rate(after, "score"),
                         "tool_call_rate_before": rate(before, "tool_call"),
                         "tool_call_rate_after": rate(after, "tool_call"),
                         "tool_errors_before": sum(r["tool_errors"] for r in before),
                         "tool_errors_after": sum(r["tool_errors"] for r in after),
                         "reward_test": paired(before, after, "score", args.seed),
                         "tool_call_test": paired(before, after, "tool_call", args.seed),
                         "grpo_logged_eval": logged_eval(work / "grpo-run"),
                         "examples_after": [r["text"] for r in after[:3]]},
            "wall_s": {**walls, "total_s": round(time.perf_counter() - started, 2)},
        }
    finally:
        if temporary is not None:
            temporary.cleanup()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
