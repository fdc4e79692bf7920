"""DPO throughput and peak memory: ``posttrain dpo`` against TRL's ``DPOTrainer`` on the same model and pairs.

Prints ONE JSON line. Each trainer runs in its own fresh subprocess (so each peak RSS is its own),
one after the other in the same invocation, on the same model directory, the same preference JSONL,
the same batch size and step count:

- ``posttrain``: ``posttrain dpo`` (reference precomputed and cached, fresh cache dir per run), default
  settings (prefix sharing on), and once more with ``dpo.prefix_sharing=false`` to show what it buys;
- ``trl``: ``trl.DPOTrainer`` with ``precompute_ref_log_probs=True`` and its fastest fair settings for
  this comparison: float32 like us (``bf16=False``; its default would autocast to bf16), no gradient
  checkpointing (its default is on; we do not checkpoint by default either), no saving, no reporting.

Figures per trainer:
- ``pairs_per_s``: pairs trained ÷ wall time of the timed steps (warm-up steps excluded). Timed from
  the end of one optimizer step to the end of the next, so data loading and collation are inside.
- ``pairs_per_s_with_reference_pass``: all trained pairs ÷ (reference pass + every step, warm-up included).
- ``reference_pass_s``: the one-off reference log-prob pass over the training pairs.
- ``peak_rss_mb``: the subprocess's peak resident set (``ru_maxrss``), imports included.

Defaults build a ~6M-parameter Llama (hidden 256, 4 layers, 4k BPE vocabulary) and pairs whose
prompt is ~120 tokens and whose chosen / rejected responses are ~80 tokens each (so each sequence is
~200 tokens) in chat format. Usage::

    python benchmarks/dpo_throughput.py                       # build model + data, run everything
    python benchmarks/dpo_throughput.py --model DIR --data pairs.jsonl --batch-size 8 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_inputs(workdir: Path, pairs: int, prompt_words: int, response_words: int, seed: int) -> tuple[str, str]:
    """A ~6M-param tiny Llama with a 4k vocabulary, and ``pairs`` conversational preference pairs."""
    from _harness import SyntheticText, write_synthetic_pairs

    from posttrain.models.tiny import build_tiny_model

    text = SyntheticText(seed)
    model = build_tiny_model(workdir / "model", texts=text.corpus(4000), vocab_size=4096, hidden_size=256, num_layers=4,
                             num_heads=4, num_kv_heads=2, max_position_embeddings=1024, seed=seed)
    data = write_synthetic_pairs(workdir / "pairs.jsonl", text, pairs, prompt_words, response_words)
    return str(model), str(data)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _summarise(step_times: list[float], warmup: int, batch: int, reference_s: float) -> dict:
    timed = step_times[warmup:]
    return {
        "pairs_per_s": batch * len(timed) / sum(timed),
        "pairs_per_s_with_reference_pass": batch * len(step_times) / (reference_s + sum(step_times)),
        "reference_pass_s": reference_s,
        "mean_step_s": sum(timed) / len(timed),
        "steps": len(step_times),
    }


def child_posttrain(args: argparse.Namespace) -> dict:
    import posttrain.train.dpo as dpo_module
    from posttrain.cli import main

    reference_s = 0.0
    compute = dpo_module.reference_logps

    def timed_reference(*a, **k):  # wraps the real pass to time it; nothing is replaced
        nonlocal reference_s
        start = time.perf_counter()
        result = compute(*a, **k)
        reference_s += time.perf_counter() - start
        return result

    dpo_module.reference_logps = timed_reference
    out = Path(args.workdir) / f"posttrain-{'shared' if args.prefix_sharing else 'rows'}"
    steps = args.warmup + args.steps
    code = main(["dpo", f"model.path={args.model}", f"data.train={args.data}", f"output_dir={out}",
                 f"train.batch_size={args.batch_size}", f"train.max_steps={steps}", "train.max_length=1024",
                 "train.lr=5e-5", "train.lr_schedule=constant", "metrics.tensorboard=false", "health.enabled=false",
                 f"dpo.prefix_sharing={str(args.prefix_sharing).lower()}",
                 f"dpo.reference_cache_dir={out / 'ref_cache'}", f"dpo.reference_batch_size={args.batch_size}"])
    if code != 0:
        raise SystemExit(f"posttrain dpo exited with {code}")
    rss = _peak_rss_mb()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["step_time_s"] for r in records if "step_time_s" in r]
    result = _summarise(step_times, args.warmup, args.batch_size, reference_s)
    pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    result.update(peak_rss_mb=rss, prefix_sharing=args.prefix_sharing,
                  mean_sequence_tokens=sum(p["chosen_tokens"] + p["rejected_tokens"] for p in pairs) / (2 * len(pairs)),
                  mean_shared_prompt_tokens=sum(p["shared_prompt_tokens"] for p in pairs) / len(pairs))
    return result


def child_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    dataset = load_dataset("json", data_files=args.data, split="train").remove_columns(["rationale"])
    reference_s = 0.0
    precompute = DPOTrainer._precompute_ref_logps

    def timed_precompute(self, *a, **k):  # wraps TRL's own pass to time it
        nonlocal reference_s
        start = time.perf_counter()
        result = precompute(self, *a, **k)
        reference_s += time.perf_counter() - start
        return result

    DPOTrainer._precompute_ref_logps = timed_precompute
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if not ends:
                ends.append(time.perf_counter())  # the first step is timed from its own start

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    config = DPOConfig(
        output_dir=str(Path(args.workdir) / "trl"), per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup + args.steps, learning_rate=5e-5, lr_scheduler_type="constant", max_length=1024,
        precompute_ref_log_probs=True, precompute_ref_batch_size=args.batch_size, gradient_checkpointing=False,
        bf16=False, fp16=False, save_strategy="no", report_to=[], logging_steps=10_000, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, use_cpu=True,
    )
    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[StepClock()])
    trainer.train()
    rss = _peak_rss_mb()
    step_times = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    result = _summarise(step_times, args.warmup, args.batch_size, reference_s)
    lengths = [len(r["prompt_ids"]) * 2 + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in trainer.train_dataset]
    result.update(peak_rss_mb=rss, mean_sequence_tokens=sum(lengths) / (2 * len(lengths)))
    return result


def _run_child(kind: str, args: argparse.Namespace, extra: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, __file__, "--child", kind, "--model", args.model, "--data", args.data,
               "--workdir", args.workdir, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
               "--warmup", str(args.warmup), *extra]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} benchmark failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model directory (default: build a ~6M-param Llama, 4k vocab)")
    parser.add_argument("--data", help="preference JSONL (default: synthetic ~200-token pairs)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--response-words", type=int, default=60)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads in each trainer")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-no-sharing", action="store_true", help="skip the prefix_sharing=false run")
    parser.add_argument("--workdir")
    parser.add_argument("--child", choices=["posttrain", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--no-prefix-sharing", dest="prefix_sharing", action="store_false", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = child_posttrain(args) if args.child == "posttrain" else child_trl(args)
        print(json.dumps(result))
        return

    with tempfile.TemporaryDirectory(prefix="dpo-bench-") as tmp:
        args.workdir = args.workdir or tmp
        pairs_needed = args.batch_size * (args.steps + args.warmup)
        if not (args.model and args.data):
            model, data = build_inputs(Path(args.workdir), pairs_needed, args.prompt_words, args.response_words, 0)
            args.model, args.data = args.model or model, args.data or data
        import torch
        from transformers import AutoConfig

        from posttrain.models.tiny import count_parameters

        config = AutoConfig.from_pretrained(args.model)
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            params = count_parameters(AutoModelForCausalLM.from_config(config))
        results = {"posttrain": _run_child("posttrain", args, [])}
        if not args.skip_no_sharing:
            results["posttrain_no_prefix_sharing"] = _run_child("posttrain", args, ["--no-prefix-sharing"])
        if not args.skip_trl:
            results["trl"] = _run_child("trl", args, [])
        ours = results["posttrain"]
        figures = {
            "benchmark": "dpo_throughput",
            "model_parameters": params,
            "vocab_size": config.vocab_size,
            "batch_size": args.batch_size,
            "timed_steps": args.steps,
            "warmup_steps": args.warmup,
            "threads": args.threads,
            "load_average_1min": os.getloadavg()[0],
            **results,
        }
        if "trl" in results:
            trl = results["trl"]
            figures["speedup_vs_trl"] = ours["pairs_per_s"] / trl["pairs_per_s"]
            figures["speedup_vs_trl_with_reference_pass"] = (
                ours["pairs_per_s_with_reference_pass"] / trl["pairs_per_s_with_reference_pass"])
            figures["peak_rss_ratio_vs_trl"] = ours["peak_rss_mb"] / trl["peak_rss_mb"]
            figures["targets_met"] = {"speedup>=2": figures["speedup_vs_trl"] >= 2.0,
                                      "peak_rss_ratio<=0.6": figures["peak_rss_ratio_vs_trl"] <= 0.6}
        if "posttrain_no_prefix_sharing" in results:
            figures["prefix_sharing_speedup"] = ours["pairs_per_s"] / results["posttrain_no_prefix_sharing"]["pairs_per_s"]
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
