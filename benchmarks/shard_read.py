"""Reading a shard set from S3 on 1 rank vs 2 ranks (``read_records(split_across_ranks=True)``).

Starts moto's loopback S3 server, writes ``--shards`` JSONL shards of ``--records`` SFT chats each, then
times ``read_records`` (list + fetch + parse + exchange of the records) inside torchrun processes with
1 rank, 2 ranks splitting the shards, and 2 ranks each reading every shard, in turn, ``--repeats`` times; the time of a run is its slowest rank's. Prints one JSON
line with the medians. Needs the test extras (moto). Each rank uses one thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(source: str, out: str) -> None:
    from posttrain import dist
    from posttrain.data import shards
    from posttrain.data.io import read_records

    if os.environ.get("SHARD_READ_NO_SPLIT"):  # every rank reads every shard: the path below the threshold
        shards.SPLIT_MIN_SHARDS = 10**9
    dist.init_distributed()
    dist.barrier()
    start = time.perf_counter()
    records, _ = read_records(source, kind="sft", progress=False, split_across_ranks=True)
    elapsed = time.perf_counter() - start
    Path(out, f"rank-{dist.rank()}.json").write_text(json.dumps({"s": elapsed, "records": len(records)}))
    dist.destroy()


def start_s3() -> tuple[subprocess.Popen, dict[str, str]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    return server, {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                    "AWS_DEFAULT_REGION": "us-east-1"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--records", type=int, default=2500, help="records per shard")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("SOURCE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    server, s3_env = start_s3()
    os.environ.update(s3_env)
    try:
        import fsspec

        fs = fsspec.filesystem("s3")
        fs.mkdir("bench")
        for shard in range(args.shards):
            rows = [{"messages": [{"role": "user", "content": f"Question {shard}-{i}: what is {i} plus {shard}?"},
                                  {"role": "assistant", "content": f"It is {i + shard}. " * 8}]}
                    for i in range(args.records)]
            fs.pipe_file(f"bench/train-{shard:05d}.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        times: dict[str, list[float]] = {"1": [], "2": [], "2-no-split": []}
        for _ in range(args.repeats):
            for label in times:
                ranks = int(label[0])
                run_env = {**env, **({"SHARD_READ_NO_SPLIT": "1"} if "no-split" in label else {})}
                with tempfile.TemporaryDirectory() as out:
                    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc_per_node={ranks}", __file__, "--worker", "s3://bench", out],
                                   cwd=ROOT, env=run_env, check=True, capture_output=True)
                    results = [json.loads(p.read_text()) for p in Path(out).glob("rank-*.json")]
                    assert all(r["records"] == args.shards * args.records for r in results)
                    times[label].append(max(r["s"] for r in results))
        one, two, every = (statistics.median(times[key]) for key in times)
        print(json.dumps({"benchmark": "shard_read", "shards": args.shards, "records_per_shard": args.records,
                          "bytes_per_shard": fs.info("bench/train-00000.jsonl")["size"], "repeats": args.repeats,
                          "read_s_1_rank": round(one, 3), "read_s_2_ranks_split": round(two, 3),
                          "read_s_2_ranks_each_reads_all": round(every, 3), "speedup_split": round(one / two, 2),
                          "cpus": os.cpu_count()}))
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
