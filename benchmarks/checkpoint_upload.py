"""What a checkpoint costs the training loop: local disk vs an s3:// run store, background vs blocking upload.

One SFT run per mode on the same model and data (``--steps`` steps, a checkpoint every ``--every``), each in
its own process, the modes interleaved over ``--repeats`` rounds:

- ``none``: no checkpoint inside the window (the baseline);
- ``local``: a local output_dir (DCP to disk);
- ``s3_background``: an s3:// output_dir on moto's S3 server on loopback, uploads in the background;
- ``s3_blocking``: the same with ``store.upload=blocking`` (the step waits for the upload).

The loop's wall time runs from the end of the first step to the end of the last (each metrics record has
the time its step ended), so start-up and the final save/upload/export are outside it. The cost of one
checkpoint is ``(wall(mode) - wall(none)) / saves``; medians over the rounds. ``--store-delay-s`` puts a
proxy in front of the store that delays every PUT (a slower, remote store). Prints one JSON line.

    python benchmarks/checkpoint_upload.py [--hidden 512 --layers 8 --steps 17 --every 4 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_moto(port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}", timeout=1).close()
            return server
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto did not start")


def make_data(path: Path, n: int) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i + 7}? Explain the steps."},
                          {"role": "assistant", "content": f"{i} plus {i + 7} is {2 * i + 7}. " * 4}]}
            for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def loop_wall(metrics: Path) -> float:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"time"' in line]
    return records[-1]["time"] - records[0]["time"]


def run(mode: str, model: Path, data: Path, work: Path, args, env: dict[str, str]) -> float:
    local = work / f"{mode}-{time.monotonic_ns()}"
    output = f"s3://posttrain-bench/{local.name}" if mode.startswith("s3") else str(local)
    overrides = [f"model.path={model}", f"data.train={data}", f"output_dir={output}", "train.batch_size=4",
                 "train.max_length=128", f"train.max_steps={args.steps}", "train.lr=1e-4", "metrics.tensorboard=false",
                 f"store.local_dir={local}", f"train.save_every={args.every if mode != 'none' else args.steps * 10}",
                 "train.keep_last=1"]
    if mode == "s3_blocking":
        overrides.append("store.upload=blocking")
    result = subprocess.run([sys.executable, "-m", "posttrain", "sft", *overrides], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} failed: {result.stderr[-2000:]}")
    return loop_wall(local / "metrics.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=17)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--store-delay-s", type=float, default=0.0)
    parser.add_argument("--port", type=int, default=5099)
    args = parser.parse_args()
    from posttrain.models.tiny import build_tiny_model, count_parameters

    work = Path(tempfile.mkdtemp(prefix="posttrain-ckpt-bench-"))
    model_dir = build_tiny_model(work / "model", vocab_size=2048, hidden_size=args.hidden, num_layers=args.layers,
                                 num_heads=8, num_kv_heads=4, intermediate_size=args.hidden * 8 // 3, seed=0)
    from transformers import AutoModelForCausalLM

    params = count_parameters(AutoModelForCausalLM.from_pretrained(model_dir))
    data = make_data(work / "train.jsonl", 4 * args.steps)
    server = start_moto(args.port)
    endpoint = f"http://127.0.0.1:{args.port}"
    proxy = None
    if args.store_delay_s > 0:
        from tests.cloud.faulty_proxy import FaultyProxy

        proxy = FaultyProxy(endpoint).__enter__()
        proxy.rules = [["PUT", "/", ("delay", args.store_delay_s), None]]
        endpoint = proxy.endpoint
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "AWS_ENDPOINT_URL": endpoint,
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "XDG_CACHE_HOME": str(work / "cache"), "TOKENIZERS_PARALLELISM": "false"}
    import s3fs

    os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                           "AWS_DEFAULT_REGION")})
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir("posttrain-bench")
    modes = ("none", "local", "s3_background", "s3_blocking")
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        for _ in range(args.repeats):
            for mode in modes:
                walls[mode].append(run(mode, model_dir, data, work, args, env))
    finally:
        if proxy is not None:
            proxy.__exit__()
        server.terminate()
    saves = (args.steps - 1) // args.every  # checkpoints between the first and the last step's end
    ckpt_dir = next((work).glob("local-*/checkpoints/step-*"))
    size_mb = sum(p.stat().st_size for p in ckpt_dir.rglob("*") if p.is_file()) / 2**20
    median = {mode: statistics.median(values) for mode, values in walls.items()}
    cost = {mode: (median[mode] - median["none"]) / saves for mode in modes if mode != "none"}
    print(json.dumps({
        "benchmark": "checkpoint_upload", "params": params, "checkpoint_mb": round(size_mb, 1), "steps": args.steps,
        "save_every": args.every, "saves_in_window": saves, "repeats": args.repeats,
        "store_delay_s_per_put": args.store_delay_s,
        "loop_wall_s_median": {m: round(v, 3) for m, v in median.items()},
        "cost_per_checkpoint_s": {m: round(v, 3) for m, v in cost.items()},
        "step_time_s_median_none": round(median["none"] / (args.steps - 1), 4),
        "machine": f"{platform.machine()} {os.cpu_count()} cores", "threads": args.threads,
    }))


if __name__ == "__main__":
    main()
