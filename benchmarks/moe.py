"""MoE training on 2 CPU ranks: FSDP2 only against expert parallelism (``parallel.expert=2``) (issue 27).

A seeded random Qwen3-MoE of ~50M total parameters (4 layers, hidden 256, 16 experts of width 640 per layer,
top-2; vocab 32,768 untied), built in memory by every rank from the same seed. Two variants, each in its own
``torchrun --nproc_per_node 2`` launch (gloo, 1 torch thread per rank), so each rank's peak RSS is its own:

- ``fsdp``: ``parallel.expert=1`` — FSDP2 shards every parameter, the experts too, and all-gathers each
  block's experts in forward and again in backward (ZeRO-3);
- ``ep2``: ``parallel.expert=2`` — each rank keeps 8 of the 16 experts of every layer and sends tokens to
  them with all-to-all; only the dense parts are gathered.

Both go through ``posttrain.train.parallelize.parallelize`` and posttrain's chunked log-prob head
(``TokenLogprobModel``); a step is forward + backward + grad-norm clip + fused AdamW, as the loop runs it, on
the same random tokens (``--batch`` rows of ``--seq`` per rank). Figures per variant and rank: the median step
time over ``--steps`` timed steps after ``--warmup-steps``; peak RSS (``ru_maxrss``) and RSS after set-up
(model + optimizer state); for ep2 the time inside the token all-to-alls and its share of the step (the
host wall time of ``all_to_all_single``, counted by ``posttrain.train.expert_parallel.timings``). Prints ONE
JSON line; figures in benchmarks/README.md ("MoE: expert parallelism").

Usage: ``.venv/bin/python benchmarks/moe.py`` (``--steps 5 --warmup-steps 2 --seq 256 --batch 4``).

``--grouped-gemm`` (prepared for the GPU machine, not yet run; one process, CUDA, bf16): the local experts of
one EP rank — 32 experts of DeepSeek-V3's shape (hidden 7168, expert width 2048: 256 experts over EP=8) on
16,384 routed rows — forward + backward as one grouped GEMM per projection (``torch._grouped_mm``, what EP
uses on CUDA) against one matmul pair per expert (the CPU path); median of 10 timed repeats, the largest
output difference between the two, and the peak memory. Without CUDA it prints a ``skipped`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"vocab_size": 32768, "hidden_size": 256, "intermediate_size": 1024, "moe_intermediate_size": 640,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "num_experts": 16, "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 4096,
         "tie_word_embeddings": False}
VARIANTS = {"fsdp": 1, "ep2": 2}


def build_model(shape: dict):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    lm = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape))
    lm.config.use_cache = False
    return lm


def parameter_counts(lm) -> dict:
    total = sum(p.numel() for p in lm.parameters())
    experts = sum(p.numel() for n, p in lm.named_parameters() if ".experts." in n)
    config = lm.config
    active = total - experts + experts * config.num_experts_per_tok // config.num_experts
    return {"total": total, "experts": experts, "active_per_token": active}


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(spec: dict) -> None:
    import resource

    import torch

    from posttrain import dist
    from posttrain.models.logprobs import TokenLogprobModel
    from posttrain.train import expert_parallel
    from posttrain.train.parallelize import parallelize

    torch.set_num_threads(1)
    dist.init_distributed()
    rank, world = dist.rank(), dist.world_size()
    lm = build_model(spec["shape"])
    counts = parameter_counts(lm)
    root = TokenLogprobModel(lm)
    applied = parallelize(root, lm, fsdp="on", precision="fp32", cpu_offload=False, activation_checkpointing="none",
                          ac_every=1, expert=spec["expert"])
    params = [p for p in root.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, spec["shape"]["vocab_size"], (spec["batch"], spec["seq"]), generator=generator)
    setup_rss = rss_mb()
    step_s, a2a_s = [], []
    for step in range(spec["warmup_steps"] + spec["steps"]):
        dist.barrier()
        before = expert_parallel.timings["all_to_all_s"]
        start = time.perf_counter()
        logprobs, _ = root(ids, ids)
        (-logprobs.mean()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if step >= spec["warmup_steps"]:
            step_s.append(time.perf_counter() - start)
            a2a_s.append(expert_parallel.timings["all_to_all_s"] - before)
    median = statistics.median(step_s)
    mine = {"rank": rank, "median_step_s": round(median, 4), "step_s": [round(s, 4) for s in step_s],
            "all_to_all_s": round(statistics.median(a2a_s), 4),
            "all_to_all_share": round(statistics.median(a / s for a, s in zip(a2a_s, step_s, strict=True)), 4),
            "rss_after_setup_mb": round(setup_rss), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    everyone = dist.gather_objects(mine)
    if rank == 0:
        Path(spec["result_path"]).write_text(json.dumps({"parameters": counts, "applied": applied, "ranks": everyone,
                                                         "world_size": world}))
    dist.destroy()


def run_variant(name: str, args: argparse.Namespace, work: Path) -> dict:
    spec = {"shape": SHAPE, "expert": VARIANTS[name], "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "warmup_steps": args.warmup_steps, "result_path": str(work / f"{name}.json")}
    (work / f"{name}.spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--child", str(work / f"{name}.spec.json")]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"variant {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(Path(spec["result_path"]).read_text())


def summarise(results: dict) -> dict:
    variants = {}
    for name, result in results.items():
        ranks = result["ranks"]
        variants[name] = {"expert": VARIANTS[name], "median_step_s": max(r["median_step_s"] for r in ranks),
                          "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks],
                          "rss_after_setup_mb_per_rank": [r["rss_after_setup_mb"] for r in ranks],
                          "all_to_all_share": max(r["all_to_all_share"] for r in ranks),
                          "all_to_all_s": max(r["all_to_all_s"] for r in ranks), "ranks": ranks}
    fsdp, ep = variants["fsdp"], variants["ep2"]
    return {"variants": variants, "ratios": {
        "ep2_over_fsdp_step": round(ep["median_step_s"] / fsdp["median_step_s"], 3),
        "ep2_over_fsdp_peak_rss": round(max(ep["peak_rss_mb_per_rank"]) / max(fsdp["peak_rss_mb_per_rank"]), 3)}}


def grouped_gemm(experts: int = 32, hidden: int = 7168, width: int = 2048, rows: int = 16384,
                 repeats: int = 10) -> dict:
    """The ``--grouped-gemm`` figures (module docstring)."""
    import torch

    from posttrain.train.expert_parallel import grouped_mm_available, local_experts

    if not torch.cuda.is_available():
        return {"benchmark": "moe_grouped_gemm", "status": "skipped", "reason": "needs a CUDA device"}
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    gate_up = (torch.randn(experts, 2 * width, hidden, device=device, dtype=dtype) * 0.02).requires_grad_()
    down = (torch.randn(experts, hidden, width, device=device, dtype=dtype) * 0.02).requires_grad_()
    # Skewed load, as routers make it: expert j gets rows in proportion to 1 / (j + 1).
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    counts = (weights / weights.sum() * rows).floor().long()
    counts[0] += rows - int(counts.sum())
    x = torch.randn(rows, hidden, device=device, dtype=dtype).requires_grad_()
    act = torch.nn.functional.silu
    results: dict = {"benchmark": "moe_grouped_gemm", "status": "ok", "experts": experts, "hidden": hidden,
                     "expert_width": width, "rows": rows, "dtype": "bfloat16",
                     "grouped_available": grouped_mm_available(x), "device": torch.cuda.get_device_name()}
    outputs = {}
    for name, grouped in (("grouped", True), ("loop", False)):
        times = []
        torch.cuda.reset_peak_memory_stats()
        for repeat in range(repeats + 2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = local_experts(x, counts.tolist(), gate_up, down, act, grouped=grouped)
            out.float().square().mean().backward()
            torch.cuda.synchronize()
            if repeat >= 2:
                times.append(time.perf_counter() - start)
            x.grad = gate_up.grad = down.grad = None
        outputs[name] = out.detach().float()
        flops = 6 * rows * 3 * hidden * width  # forward + backward of three [hidden x width] projections per row
        median = statistics.median(times)
        results[name] = {"median_s": round(median, 5), "tflops": round(flops / median / 1e12, 2),
                         "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    results["max_abs_diff"] = float((outputs["grouped"] - outputs["loop"]).abs().max())
    results["grouped_speedup"] = round(results["loop"]["median_s"] / results["grouped"]["median_s"], 2)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="rows of --seq tokens per rank per step")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--grouped-gemm", action="store_true", help="the GPU check of the local experts' grouped GEMM")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.grouped_gemm:
        print(json.dumps(grouped_gemm()))
        return 0
    if args.child:
        child(json.loads(Path(args.child).read_text()))
        return 0
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="posttrain-moe-bench-") as tmp:
        results = {name: run_variant(name, args, Path(tmp)) for name in VARIANTS}
    import platform

    import torch

    first = next(iter(results.values()))
    line = {"benchmark": "moe", "model": {"arch": "qwen3_moe", **{k: SHAPE[k] for k in (
        "num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "vocab_size")}, "parameters": first["parameters"]},
        "world_size": first["world_size"], "tokens_per_rank_per_step": args.batch * args.seq, "steps": args.steps,
        "warmup_steps": args.warmup_steps, "precision": "fp32", "backend": "gloo", **summarise(results),
        "machine": {"cores": os.cpu_count(), "torch_threads_per_rank": 1,
                    "load_avg_1m_start_end": [round(load_at_start, 2), round(os.getloadavg()[0], 2)],
                    "python": platform.python_version(), "torch": torch.__version__}}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
