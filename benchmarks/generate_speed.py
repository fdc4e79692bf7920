"""Generation throughput of the HF backend: generated tokens per second, batched vs one prompt at a time.

    python benchmarks/generate_speed.py [--model DIR] [--prompts N] [--n G] [--max-new-tokens K] [--batch-size B]
                                        [--logprobs]

Without --model a seeded tiny Llama (``--hidden-size``, ``--layers``) is built in a temporary directory.
Sampling runs with temperature 1 and no EOS stopping is forced, so the token count is what was generated.
``--n G`` samples G completions per prompt (a GRPO group); ``--logprobs`` records per-token log-probs.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch

from posttrain.generate import HFBackend, SamplingParams
from posttrain.models.tiny import DEFAULT_TEXTS, build_tiny_model

PROMPT_STEMS = [
    "What is 12 plus 30?",
    "Reverse the word hello.",
    "Which number is larger, 17 or 71? Explain briefly.",
    "Write a list of three fruits.",
    "The quick brown fox jumps over the lazy dog. Summarise this sentence in five words.",
    "Sort 3, 1, 2 in increasing order.",
]


def measure(backend: HFBackend, prompts: list[str], params: SamplingParams, batch_size: int, repeats: int) -> dict:
    """Median over ``repeats`` runs of wall and process CPU time (CPU time is steadier on a shared machine)."""
    backend.generate(prompts[:batch_size], SamplingParams(max_new_tokens=4), batch_size=batch_size, progress=False)
    walls, cpus = [], []
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), time.process_time()
        results = backend.generate(prompts, params, batch_size=batch_size, progress=False)
        walls.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu_started)
    tokens = sum(len(c.token_ids) for row in results for c in row)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    return {"tokens": tokens, "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "cpu_tokens_per_s": round(tokens / cpu, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model directory (default: build a tiny one)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--logprobs", action="store_true", help="record per-token log-probs while sampling")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=256, help="tiny model width when --model is not given")
    parser.add_argument("--layers", type=int, default=4, help="tiny model depth when --model is not given")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    parser.add_argument("--skip-unbatched", action="store_true", help="do not measure batch size 1")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(
            os.path.join(tmp, "model"), texts=DEFAULT_TEXTS * 8, vocab_size=1000,
            hidden_size=args.hidden_size, num_layers=args.layers, num_heads=max(1, args.hidden_size // 64),
            num_kv_heads=max(1, args.hidden_size // 128), seed=0))
        backend = HFBackend.from_path(model_dir, dtype=args.dtype, device=args.device)
        parameters = sum(p.numel() for p in backend.model.parameters())
        prompts = [PROMPT_STEMS[i % len(PROMPT_STEMS)] + f" (#{i})" for i in range(args.prompts)]
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0,
                                **({"logprobs": True} if args.logprobs else {}))
        batched = measure(backend, prompts, params, args.batch_size, args.repeats)
        record = {
            "benchmark": "generate_speed",
            "model": args.model or f"tiny-llama h{args.hidden_size} l{args.layers}",
            "parameters": parameters,
            "device": str(backend.device),
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "prompts": args.prompts,
            "n": args.n,
            "logprobs": args.logprobs,
            "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size,
            "generated_tokens": batched["tokens"],
            "seconds": batched["seconds"],
            "tokens_per_s": batched["tokens_per_s"],
            "cpu_tokens_per_s": batched["cpu_tokens_per_s"],
            "repeats": args.repeats,
        }
        if not args.skip_unbatched:
            single = measure(backend, prompts, params, 1, args.repeats)
            record["tokens_per_s_batch1"] = single["tokens_per_s"]
            record["batching_speedup"] = round(batched["tokens_per_s"] / single["tokens_per_s"], 2)
        record["machine"] = f"{platform.machine()} {os.cpu_count()} cpus"
        print(json.dumps(record))


if __name__ == "__main__":
    main()
