"""Thread-count policies for torch on shared CPUs: a fixed training workload alone and beside a copy of itself.

The workload is what the quickstart's SFT stage does: a tiny Llama (the quickstart's base model: hidden
128, 4 layers, 4 heads, 1024-token vocabulary) trained with AdamW on batches of 16 × 128 tokens, for
``--steps`` optimizer steps after 2 warm-up steps. Each run happens in a fresh process, because OpenMP
reads its settings once, when torch loads it.

Policies (``--policies``):
  torch_default   nothing set: torch's own default (one thread per core, OpenMP spin-waiting)
  one             OMP_NUM_THREADS=1
  all_passive     OMP_NUM_THREADS=<cores>, OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps at once)
  all_spinN       OMP_NUM_THREADS=<cores>, GOMP_SPINCOUNT=N (libgomp, which torch's Linux wheels use:
                  spin N iterations, then sleep; unset, libgomp spins 300 000 and torch's gaps between
                  parallel regions are shorter than that, so an idle thread never sleeps)
  posttrain       whatever posttrain.threads.configure_threads(None) chooses in that process

For each policy the workload runs alone, then as two copies started together (``pair``). That is one
round; ``--repeats`` rounds run, each with the policies in a rotated order so that a burst of load from
other users does not always hit the same policy. Printed: one JSON line with, per policy, the median
over rounds of the loop seconds alone and of the mean loop seconds of the two copies, the slowdown
(pair / alone), the CPU seconds each copy burnt (all its threads: spinning shows up here, and it is
what a neighbour loses), every round's figures and the 1-minute load average before each run, and the thread
counts chosen. On a shared machine the figures move with other users' load; re-run on a quiet machine
before quoting one:

    .venv/bin/python benchmarks/threads.py            # defaults: --steps 40 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

POLICIES = ("torch_default", "one", "all_passive", "all_spin10000", "posttrain")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "GOMP_SPINCOUNT")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def policy_env(policy: str) -> dict[str, str]:
    """The environment a worker starts with: this one minus every thread setting, plus the policy's."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    if policy == "one":
        env["OMP_NUM_THREADS"] = "1"
    elif policy == "all_passive":
        env.update(OMP_NUM_THREADS=str(_cores()), OMP_WAIT_POLICY="PASSIVE")
    elif policy.startswith("all_spin") and policy.removeprefix("all_spin").isdigit():
        env.update(OMP_NUM_THREADS=str(_cores()), GOMP_SPINCOUNT=policy.removeprefix("all_spin"))
    elif policy not in ("torch_default", "posttrain"):
        raise SystemExit(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    return env


def worker(policy: str, steps: int, hidden: int) -> None:
    reason = policy
    if policy == "posttrain":
        from posttrain.threads import configure_threads

        reason = configure_threads(None).reason
    import torch
    from transformers import LlamaForCausalLM

    from posttrain.models.tiny import tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=1024, hidden_size=hidden, num_layers=4, num_heads=4, num_kv_heads=4)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(3, 1024, (16, 128))

    def step() -> None:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({"threads": torch.get_num_threads(), "reason": reason, "loop_s": round(seconds, 3),
                      "cpu_s": round(cpu, 3)}))


def run_copies(policy: str, copies: int, steps: int, hidden: int) -> dict:
    load = os.getloadavg()[0]
    command = [sys.executable, __file__, "--worker", policy, "--steps", str(steps), "--hidden", str(hidden)]
    procs = [subprocess.Popen(command, env=policy_env(policy), stdout=subprocess.PIPE, text=True)
             for _ in range(copies)]
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"worker {policy} failed with exit code {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    loops, cpus = [r["loop_s"] for r in results], [r["cpu_s"] for r in results]
    return {"load_before": round(load, 2), "loop_s": loops, "mean_loop_s": round(sum(loops) / len(loops), 3),
            "mean_cpu_s": round(sum(cpus) / len(cpus), 3),
            "threads": [r["threads"] for r in results], "reason": [r["reason"] for r in results]}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps per run (after 2 warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every policy alone and in a pair")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the model (128: the quickstart's)")
    parser.add_argument("--alone-only", action="store_true", help="skip the pairs (e.g. to see how a size scales)")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, from {', '.join(POLICIES)}")
    parser.add_argument("--worker", metavar="POLICY", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.hidden)
        return
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    rounds: dict[str, list[dict]] = {policy: [] for policy in policies}
    for index in range(args.repeats):
        for policy in policies[index % len(policies):] + policies[:index % len(policies)]:
            alone = run_copies(policy, 1, args.steps, args.hidden)
            pair = alone if args.alone_only else run_copies(policy, 2, args.steps, args.hidden)
            rounds[policy].append({"alone": alone, "pair": pair})
            print(f"[threads] round {index + 1} {policy}: alone {alone}, pair {pair}", file=sys.stderr, flush=True)
    figures = {}
    for policy, runs in rounds.items():
        alone_s = _median([r["alone"]["mean_loop_s"] for r in runs])
        pair_s = _median([r["pair"]["mean_loop_s"] for r in runs])
        figures[policy] = {
            "alone_s": round(alone_s, 3), "pair_s": round(pair_s, 3), "slowdown": round(pair_s / alone_s, 2),
            "alone_cpu_s": round(_median([r["alone"]["mean_cpu_s"] for r in runs]), 3),
            "pair_cpu_s": round(_median([r["pair"]["mean_cpu_s"] for r in runs]), 3),
            "alone_rounds_s": [r["alone"]["mean_loop_s"] for r in runs],
            "pair_rounds_s": [r["pair"]["mean_loop_s"] for r in runs],
            "load_before": [[r["alone"]["load_before"], r["pair"]["load_before"]] for r in runs],
            "threads_alone": [r["alone"]["threads"][0] for r in runs],
            "threads_pair": [r["pair"]["threads"] for r in runs],
        }
    print(json.dumps({"benchmark": "threads", "steps": args.steps, "repeats": args.repeats, "batch": [16, 128],
                      "model": f"tiny-llama h{args.hidden} l4 v1024", "alone_only": args.alone_only, "cores": _cores(),
                      "machine": f"{platform.machine()} {os.cpu_count()} cpus", "policies": figures}))


if __name__ == "__main__":
    main()
