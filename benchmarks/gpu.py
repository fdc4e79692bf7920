"""GPU throughput, MFU and peak memory of posttrain's SFT and DPO on Llama-shaped ~1B and ~8B models (issue #17).

One prepared script for one GPU (an H200 here), inside one 10-minute command with its installs
(benchmarks/README.md, "GPU (prepared, not yet run)"). It builds the models itself (random weights,
no hub: ``posttrain.models.tiny.build_tiny_model`` with the Llama-3.2-1B and Llama-3-8B shapes, vocab
128,256, initialised on the GPU and saved in bf16), writes synthetic chats and preference pairs, and
runs every row in its own subprocess (a crash or OOM loses one row; peak memory is that process's
``torch.cuda.max_memory_allocated``) through posttrain's real path: the ``posttrain sft`` / ``posttrain
dpo`` CLI on a YAML config, as ``posttrain train`` runs it. TRL's ``SFTTrainer`` / ``DPOTrainer`` rows
use the same model, data, batch and settings where TRL imports. Rows run most important first
(``ROWS``) while ``--budget-s`` lasts; the rest are listed as skipped. Each finished row is appended
to ``--out`` at once; ONE JSON line is printed at the end.

Figures per row, over the timed steps (after ``warmup`` untimed ones):

- step time: the median of the wall times between the ends of consecutive optimizer steps, each end
  taken after ``torch.cuda.synchronize()`` (so queued kernels are inside the step they belong to);
- ``tokens_per_s`` = mean real tokens per timed step / median step time. Real tokens exclude padding;
  for DPO they are the tokens of both sequences of each pair (prompt + chosen + prompt + rejected),
  the same count for posttrain (which computes the shared prompt once) and TRL;
- ``mfu`` = mean FLOPs per timed step / (median step time × measured peak), with the model FLOPs

      F = 6 · N · T + 12 · L · d · P

  N = parameters that multiply every token: the decoder blocks, the final norm and the output head
  (V·h, counted also when it is tied to the embedding; the embedding lookup itself is not a matmul);
  T = tokens the model computes (packed SFT: real tokens; DPO with prefix sharing: the shared prompt
  once); L = layers; d = query width (heads × head_dim); P = (query, key) pairs the attention mask
  allows, summed over the batch. A packed row of causal segments s_1..s_k (examples never see each
  other) has P = Σ s_i (s_i + 1) / 2; a prefix-shared DPO row (prompt p, chosen c, rejected r) has
  p(p+1)/2 + (c·p + c(c+1)/2) + (r·p + r(r+1)/2). Per allowed pair, QKᵀ and AV cost 2·d FLOPs each
  forward, ×3 with backward: 12·d per layer. Departures: PaLM's and posttrain.plan.timing's
  12·L·h·s² count the full s×s square (≈ 2 × P for one causal segment); recomputation (activation
  checkpointing) is not counted (MFU is model FLOPs); 6·N·T counts the output head on every token,
  though posttrain computes it on loss positions only, which credits that saving to MFU as it does to
  tokens/s.
- the peak: median TFLOP/s of ``--peak-repeats`` timed 8192³ bf16 matmuls on random data after
  warm-up, measured by this script in its own subprocess (``peak``); the card's datasheet is not used.
- ``peak_memory_gib`` (``max_memory_allocated``) beside ``plan_peak_gib``, the ``posttrain plan``
  estimate (posttrain.plan.report.build_plan) for the same shape, sequence, micro-batch and AC mode,
  and their ratio. The plan models FSDP2 bf16 mixed precision (18 B/param); a one-GPU run keeps
  fp32 weights, grads and Adam state (16 B/param) plus autocast's bf16 weight copies. It has no mode
  for posttrain's ``selective`` (every 2nd block checkpointed; both bounds given) nor for activation
  offload (the no-offload estimate is given).

After the training rows, while the budget lasts, **script rows** run other benchmarks' GPU modes in their own
process and keep their one JSON line (``script_rows``): the MoE experts' grouped GEMM against the per-expert
loop at DeepSeek-V3's expert shape (``benchmarks/moe.py --grouped-gemm``, issue 27) and vLLM against HF
rollout tokens/s with weight-sync seconds on the ~1B Llama (``benchmarks/rollout_engines.py --models 1b``,
issue 26; it needs a Python with GPU vLLM — ``$POSTTRAIN_VLLM_PYTHON`` — and says so when there is none).

``--smoke`` runs the same rows on CPU with tiny models (hidden 64, 2 layers, seq 256, 1 timed step)
to prove the script end to end; its peak is measured but flagged ``"device": "cpu"`` and is no claim.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # Llama-3.2-1B and Llama-3-8B as published (config.json); smoke: the test-sized Llama
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8,
           "model_vocab_size": 128256, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
           "model_vocab_size": 128256, "tie_word_embeddings": False},
    "smoke": {"hidden_size": 64, "intermediate_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "model_vocab_size": 1024, "tie_word_embeddings": False},
}
GIB = 2**30

# ----------------------------------------------------------------------------- the formulas (pure)


def causal_segment_pairs(segment_lengths: list[int]) -> int:
    """(query, key) pairs of causal attention within each segment, none across: Σ s (s + 1) / 2."""
    return sum(s * (s + 1) // 2 for s in segment_lengths)


def prefix_shared_pairs(prompt: int, chosen: int, rejected: int) -> int:
    """Pairs of one prefix-shared DPO row: the prompt causally, each response over the prompt and itself."""
    return causal_segment_pairs([prompt]) + sum(n * prompt + n * (n + 1) // 2 for n in (chosen, rejected))


def segments_from_positions(position_ids: list[int], input_ids: list[int], pad_id: int | None) -> list[int]:
    """Lengths of a packed row's segments (``posttrain.models.attention.segment_boundaries``: the rule the
    varlen kernel and transformers' mask use), padding dropped.

    A segment made only of ``pad_id`` tokens is the row's padding, not an example.
    """
    import torch

    from posttrain.models.attention import segment_boundaries

    starts = segment_boundaries(torch.tensor([position_ids]))[0].tolist()
    return [b - a for a, b in zip(starts, starts[1:], strict=False)
            if pad_id is None or any(t != pad_id for t in input_ids[a:b])]


def flop_params(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
                head_dim: int | None = None) -> int:
    """N of 6·N·T: decoder blocks + final norm + output head (module docstring; tied or not)."""
    from posttrain.plan.shapes import ModelShape

    shape = ModelShape("n", hidden, intermediate, layers, heads, kv_heads, vocab, head_dim=head_dim or 0)
    return layers * shape.block_params() + hidden + vocab * hidden


def step_flops(n_params: int, layers: int, attention_width: int, tokens: int, attention_pairs: int) -> float:
    """F = 6·N·T + 12·L·d·P (module docstring)."""
    return 6.0 * n_params * tokens + 12.0 * layers * attention_width * attention_pairs


def mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    return flops / (seconds * peak_flops_per_s)


# ----------------------------------------------------------------------------- the rows

Row = dict


def _row(name: str, recipe: str, size: str, framework: str = "posttrain", **settings) -> Row:
    base = {"compile": False, "liger": False, "attn": None, "ac": "full", "activation_offload": False,
            "cpu_offload": False, "dtype": "float32", "only_if_failed": None}
    return {"name": name, "recipe": recipe, "size": size, "framework": framework, **base, **settings}


def gpu_rows() -> list[Row]:
    """Most important first (budget order). 8B: AC full, 2 rows of 4096 per step, no accumulation: the plan
    puts fp32-state AdamW at ~139 GiB there (module docstring); the bf16-weights row runs only if that OOMs."""
    big, small = {"batch_size": 2, "global_batch": 2}, {"batch_size": 4, "global_batch": 4}
    dpo_big, dpo_small = {"batch_size": 4, "global_batch": 4}, {"batch_size": 8, "global_batch": 8}
    return [
        _row("sft-8b-compile", "sft", "8b", compile=True, **big),
        _row("trl-sft-8b", "sft", "8b", framework="trl", **big),
        _row("dpo-8b-compile", "dpo", "8b", compile=True, **dpo_big),
        _row("trl-dpo-8b", "dpo", "8b", framework="trl", **dpo_big),
        _row("sft-8b-bf16-weights-compile", "sft", "8b", compile=True, dtype="bfloat16", only_if_failed="sft-8b-compile", **big),
        _row("sft-8b-compile-liger", "sft", "8b", compile=True, liger=True, **big),
        _row("sft-8b-eager", "sft", "8b", **big),
        _row("sft-1b-compile", "sft", "1b", compile=True, ac="none", **small),
        _row("sft-1b-eager", "sft", "1b", ac="none", **small),
        _row("sft-1b-compile-liger", "sft", "1b", compile=True, liger=True, ac="none", **small),
        _row("sft-1b-eager-liger", "sft", "1b", liger=True, ac="none", **small),
        _row("trl-sft-1b", "sft", "1b", framework="trl", ac="none", **small),
        _row("sft-1b-attn-sdpa", "sft", "1b", attn="sdpa", ac="none", **small),
        _row("sft-1b-attn-varlen", "sft", "1b", attn="varlen", ac="none", **small),
        _row("act-1b-selective", "sft", "1b", ac="selective", **small),
        _row("act-1b-full", "sft", "1b", ac="full", **small),
        _row("act-1b-offload", "sft", "1b", ac="none", activation_offload=True, **small),
        _row("dpo-1b-compile", "dpo", "1b", compile=True, ac="none", **dpo_small),
        _row("trl-dpo-1b", "dpo", "1b", framework="trl", ac="none", **dpo_small),
        _row("sft-8b-cpu-offload", "sft", "8b", cpu_offload=True, **big),
    ]


def smoke_rows() -> list[Row]:
    one = {"batch_size": 2, "global_batch": 2}
    return [
        _row("sft-smoke", "sft", "smoke", ac="none", **one),
        _row("trl-sft-smoke", "sft", "smoke", framework="trl", ac="none", **one),
        _row("dpo-smoke", "dpo", "smoke", ac="none", **one),
        _row("trl-dpo-smoke", "dpo", "smoke", framework="trl", ac="none", **one),
        _row("sft-smoke-compile", "sft", "smoke", compile=True, ac="none", **one),
        _row("sft-smoke-liger", "sft", "smoke", liger=True, ac="none", **one),
        _row("act-smoke-selective", "sft", "smoke", ac="selective", **one),
        _row("act-smoke-full", "sft", "smoke", ac="full", **one),
        _row("act-smoke-offload", "sft", "smoke", ac="none", activation_offload=True, **one),
        _row("sft-smoke-cpu-offload", "sft", "smoke", cpu_offload=True, ac="none", **one),
    ]


def script_rows(smoke: bool) -> list[Row]:
    """Other benchmarks' GPU modes (module docstring); ``estimate_s`` is what the budget must still hold. On
    ``--smoke`` only the grouped-GEMM row, which prints its ``skipped`` line at once without CUDA."""
    rows = [{"name": "moe-grouped-gemm", "kind": "script", "estimate_s": 60.0,
             "command": ["benchmarks/moe.py", "--grouped-gemm"]}]
    if not smoke:
        rows.append({"name": "rollout-1b", "kind": "script", "estimate_s": 300.0,
                     "command": ["benchmarks/rollout_engines.py", "--models", "1b", "--prompts", "64", "--n", "8",
                                 "--max-new-tokens", "256", "--repeats", "2"]})
    return rows


def run_script(row: Row, timeout_s: float, smoke: bool) -> dict:
    """A script row in its own process: its last stdout line as JSON, or why there is none."""
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *row["command"]], cwd=ROOT, env=child_env(smoke), capture_output=True,
                              text=True, timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        return {"name": row["name"], "status": "timeout", "wall_s": round(time.perf_counter() - start, 1)}
    wall = round(time.perf_counter() - start, 1)
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except json.JSONDecodeError:
        result = None
    if result is None:
        return {"name": row["name"], "status": "failed", "exit_code": proc.returncode, "wall_s": wall,
                "log_tail": (proc.stderr or proc.stdout)[-600:]}
    status = "skipped" if result.get("skipped") or result.get("status") == "skipped" else "ok"
    return {"name": row["name"], "status": status, "wall_s": wall, "result": result}


def geometry(smoke: bool) -> dict:
    """Sequence lengths, data sizes and step counts."""
    if smoke:
        return {"seq": 256, "dpo_max_length": 256, "chat_user": (5, 20), "chat_assistant": (20, 80),
                "pair_prompt": (20, 40), "pair_response": (10, 30), "warmup": 1, "steps": 1, "tokenizer_vocab": 512}
    return {"seq": 4096, "dpo_max_length": 2048, "chat_user": (50, 300), "chat_assistant": (150, 1200),
            "pair_prompt": (200, 600), "pair_response": (150, 450), "warmup": 2, "steps": 3, "tokenizer_vocab": 4096}


# ----------------------------------------------------------------------------- the plan estimate


def plan_estimate(model_dir: Path, row: Row, seq: int) -> dict:
    """``posttrain plan``'s peak per GPU for the row's config on one GPU (module docstring for what it models)."""
    from posttrain.plan.report import PlanInputs, build_plan
    from posttrain.plan.shapes import load_shape

    shape = load_shape(str(model_dir))
    offload = "params" if row["cpu_offload"] else "none"

    def peak(ac: str) -> float:
        inputs = PlanInputs(gpus=1, gpus_per_node=1, recipe=row["recipe"], ac=ac, seq=seq,
                            micro_batch=row["batch_size"], offload=offload)
        return build_plan(shape, inputs)["memory_bytes"]["peak_per_gpu"] / GIB

    if row["ac"] == "selective":
        return {"plan_peak_gib": None, "plan_peak_gib_bounds": [round(peak("full"), 2), round(peak("none"), 2)]}
    return {"plan_peak_gib": round(peak(row["ac"]), 2)}


# ----------------------------------------------------------------------------- the parent


def build_inputs(work: Path, smoke: bool, sizes: set[str], geo: dict, pairs: int, chats: int) -> dict:
    """Models (one per size, built once per work dir) and the SFT / DPO data; build times per item."""
    from _harness import SyntheticText, write_synthetic_chats, write_synthetic_pairs

    work.mkdir(parents=True, exist_ok=True)
    text = SyntheticText(0)
    built: dict = {"build_s": {}}
    start = time.perf_counter()
    built["sft_data"] = str(write_synthetic_chats(work / "chats.jsonl", text, chats, geo["chat_user"], geo["chat_assistant"]))
    built["dpo_data"] = str(write_synthetic_pairs(work / "pairs.jsonl", text, pairs, geo["pair_prompt"], geo["pair_response"]))
    built["build_s"]["data"] = round(time.perf_counter() - start, 2)
    for size in sorted(sizes):
        model_dir = work / f"model-{size}"
        if not (model_dir / "config.json").exists():
            start = time.perf_counter()
            # Its own process: the GPU memory of the draw is given back before any row starts.
            code = subprocess.run([sys.executable, __file__, "--build-model", size, "--work-dir", str(work),
                                   *(["--smoke"] if smoke else [])], env=child_env(smoke)).returncode
            if code != 0:
                raise SystemExit(f"building the {size} model failed (exit code {code})")
            built["build_s"][f"model_{size}"] = round(time.perf_counter() - start, 2)
        built[f"model_{size}"] = str(model_dir)
    return built


def build_model(size: str, work: Path, smoke: bool) -> None:
    import torch
    from _harness import SyntheticText

    from posttrain.models.tiny import build_tiny_model

    geo = geometry(smoke)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    build_tiny_model(work / f"model-{size}", texts=SyntheticText(0).corpus(500 if smoke else 4000), vocab_size=geo["tokenizer_vocab"],
                     max_position_embeddings=max(8192, geo["seq"]), init_device=device,
                     save_dtype=torch.bfloat16 if device == "cuda" else None, **SHAPES[size])


def child_env(smoke: bool) -> dict:
    threads = "1" if smoke else "8"
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def run_child(spec: dict, work: Path, timeout_s: float, smoke: bool) -> dict:
    """One row (or the peak) in its own process; its result file, or why there is none."""
    run_dir = work / "rows" / spec["name"]
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out_dir": str(run_dir / "out"), "result_path": str(run_dir / "result.json")}
    Path(spec["result_path"]).unlink(missing_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    start = time.perf_counter()
    with open(run_dir / "child.log", "w") as log:
        try:
            code = subprocess.run([sys.executable, __file__, "--child", str(run_dir / "spec.json")], stdout=log,
                                  stderr=subprocess.STDOUT, env=child_env(smoke), timeout=max(timeout_s, 1)).returncode
        except subprocess.TimeoutExpired:
            code = None
    wall = round(time.perf_counter() - start, 1)
    tail = (run_dir / "child.log").read_text(errors="replace")[-1500:]
    if Path(spec["result_path"]).exists():
        return {**json.loads(Path(spec["result_path"]).read_text()), "wall_s": wall}
    status = "timeout" if code is None else ("oom" if "OutOfMemoryError" in tail or "out of memory" in tail else "failed")
    return {"status": status, "exit_code": code, "wall_s": wall, "log_tail": tail[-600:]}


def machine_info(peak: dict) -> dict:
    import torch
    import transformers

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name in ("trl", "liger_kernel"):
        try:
            info[name] = __import__(name).__version__ if name == "trl" else "installed"
        except Exception as exc:  # noqa: BLE001 - reported, the rows that need it say skipped
            info[name] = f"not importable: {type(exc).__name__}: {str(exc)[:120]}"
    return {**info, "peak_tflops": peak.get("tflops"), "peak": peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models, 1 timed step per row")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall seconds for everything after start-up")
    parser.add_argument("--rows", help="comma list of row names to run (default: all, in order)")
    parser.add_argument("--work-dir", default="runs/bench/gpu", help="models, data and each row's run directory")
    parser.add_argument("--out", default="runs/bench/gpu/results.json", help="partial results, rewritten after each row")
    parser.add_argument("--peak-size", type=int, default=None, help="matmul size for the peak (default 8192; smoke 256)")
    parser.add_argument("--peak-repeats", type=int, default=10)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--build-model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _gpu_child import child_main

    if args.child:
        return child_main(args.child)
    work = Path(args.work_dir).resolve()
    if args.build_model:
        build_model(args.build_model, work, args.smoke)
        return 0
    started = time.perf_counter()
    rows = smoke_rows() if args.smoke else gpu_rows()
    scripts = script_rows(args.smoke)
    if args.rows:
        wanted = args.rows.split(",")
        unknown = sorted(set(wanted) - {r["name"] for r in rows + scripts})
        if unknown:
            raise SystemExit(f"--rows: unknown {unknown}; rows: {', '.join(r['name'] for r in rows + scripts)}")
        rows = [r for r in rows if r["name"] in wanted]
        scripts = [r for r in scripts if r["name"] in wanted]
    geo = geometry(args.smoke)
    steps = geo["warmup"] + geo["steps"]
    most_units = max((r["global_batch"] for r in rows), default=1) * (steps + 1)
    per_row = geo["seq"] // 400 + 2  # chats per packed row, with room
    inputs = build_inputs(work, args.smoke, {r["size"] for r in rows}, geo, pairs=most_units, chats=most_units * per_row)
    peak = run_child({"name": "peak", "kind": "peak", "size": args.peak_size or (256 if args.smoke else 8192),
                      "repeats": args.peak_repeats}, work, 120, args.smoke)
    peak_flops = (peak.get("tflops") or 0) * 1e12
    report = {"benchmark": "gpu", "smoke": args.smoke, "budget_s": args.budget_s, "geometry": geo,
              "build_s": inputs["build_s"], "machine": machine_info(peak), "rows": [], "skipped": []}
    estimate = {"smoke": 60.0, "1b": 90.0, "8b": 150.0}  # first guesses; each finished row updates its size's
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    status: dict[str, str] = {}
    for row in rows:
        left = args.budget_s - (time.perf_counter() - started)
        if row["only_if_failed"] and status.get(row["only_if_failed"], "ok") == "ok":
            report["skipped"].append({"name": row["name"], "reason": f"runs only if {row['only_if_failed']} failed"})
            continue
        if estimate[row["size"]] > left:
            report["skipped"].append({"name": row["name"], "reason": f"budget: {left:.0f}s left, row needs ~{estimate[row['size']]:.0f}s"})
            continue
        spec = {**row, "kind": "row", "model": inputs[f"model_{row['size']}"], "peak_flops": peak_flops,
                "data": inputs["sft_data" if row["recipe"] == "sft" else "dpo_data"],
                "max_length": geo["seq"] if row["recipe"] == "sft" else geo["dpo_max_length"],
                "warmup": geo["warmup"], "steps": geo["steps"]}
        result = {**row, **run_child(spec, work, left, args.smoke)}
        result.pop("only_if_failed", None)
        if result.get("status") == "ok" and not row["cpu_offload"]:
            result.update(plan_estimate(Path(spec["model"]), row, spec["max_length"]))
            if result.get("plan_peak_gib") and result["memory_device"] == "cuda":
                result["peak_vs_plan"] = round(result["peak_memory_gib"] / result["plan_peak_gib"], 3)
        status[row["name"]] = result.get("status", "failed")
        if result.get("status") in ("ok", "failed", "oom"):
            estimate[row["size"]] = max(estimate[row["size"]] * 0.5, result["wall_s"] * 1.1)
        report["rows"].append(result)
        print(f"[gpu] {row['name']}: {result.get('status')} {result.get('tokens_per_s', '')} tok/s "
              f"mfu {result.get('mfu', '')} peak {result.get('peak_memory_gib', '')} GiB ({result['wall_s']}s)",
              file=sys.stderr, flush=True)
        out.write_text(json.dumps(report, indent=1))
    for row in scripts:
        left = args.budget_s - (time.perf_counter() - started)
        if row["estimate_s"] > left:
            report["skipped"].append({"name": row["name"], "reason": f"budget: {left:.0f}s left, row needs ~{row['estimate_s']:.0f}s"})
            continue
        result = run_script(row, left, args.smoke)
        report["rows"].append(result)
        print(f"[gpu] {row['name']}: {result['status']} ({result['wall_s']}s)", file=sys.stderr, flush=True)
        out.write_text(json.dumps(report, indent=1))
    add_comparisons(report)
    report["total_s"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


def add_comparisons(report: dict) -> None:
    """posttrain ÷ TRL tokens/s on the same model and batch, and the activation rows against AC none."""
    by_name = {r["name"]: r for r in report["rows"] if r.get("status") == "ok"}
    ratios = {}
    for trl_name, ours_name in (("trl-sft-8b", "sft-8b-compile"), ("trl-dpo-8b", "dpo-8b-compile"),
                                ("trl-sft-1b", "sft-1b-compile"), ("trl-dpo-1b", "dpo-1b-compile"),
                                ("trl-sft-smoke", "sft-smoke"), ("trl-dpo-smoke", "dpo-smoke")):
        if trl_name in by_name and ours_name in by_name:
            ratios[f"{ours_name}/{trl_name}"] = round(by_name[ours_name]["tokens_per_s"] / by_name[trl_name]["tokens_per_s"], 3)
    report["tokens_per_s_vs_trl"] = ratios
    base = by_name.get("sft-1b-eager") or by_name.get("sft-smoke")
    if base:
        report["activation_memory_vs_ac_none"] = {
            name: {"peak_memory_saved_gib": round(base["peak_memory_gib"] - r["peak_memory_gib"], 3),
                   "step_time_ratio": round(r["median_step_s"] / base["median_step_s"], 3)}
            for name, r in by_name.items() if name.startswith("act-")}
    targets = {}
    if "sft-8b-compile" in by_name:
        targets["sft_8b_mfu>=0.45"] = by_name["sft-8b-compile"]["mfu"] >= 0.45
    if "dpo-8b-compile" in by_name:
        targets["dpo_8b_mfu>=0.40"] = by_name["dpo-8b-compile"]["mfu"] >= 0.40
    for key, value in ratios.items():
        if "8b" in key:
            targets[f"{key}>=1.3"] = value >= 1.3
    report["targets_met"] = targets


if __name__ == "__main__":
    sys.exit(main())
