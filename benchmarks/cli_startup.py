"""Wall time of first contact with the CLI: ``posttrain --help``, ``--version``, ``validate`` on a packaged
recipe and every subcommand's ``--help``, each in a fresh process (the target: under a second).

Each command runs ``--repeats`` times (after one untimed run that warms the OS file cache); the median is
reported. Printed: one JSON line with the median seconds per command, the slowest, and the 1-minute load
average before and after (the machine may be shared; re-run on a quiet one before quoting a figure):

    .venv/bin/python benchmarks/cli_startup.py             # defaults: --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

COMMANDS = [
    ["--help"],
    ["--version"],
    ["validate", "--quiet", "--config", "sft_tiny"],
    ["validate", "--quiet", "--config", "quickstart"],
    ["validate", "--quiet", "--config", "dpo_tiny"],  # imports torch today (the DPO loss registry)
    ["recipes", "list"],
    ["data", "inspect", "--help"],
    ["model", "tiny", "--help"],
    ["quickstart", "--help"],
    ["generate", "--help"],
    ["eval", "--help"],
    ["eval", "compare", "--help"],
    ["sft", "--help"],
    ["pretrain", "--help"],
    ["dpo", "--help"],
    ["rm", "--help"],
    ["curate", "--help"],
    ["sample", "--help"],
    ["feedback", "--help"],
    ["flywheel", "--help"],
]


def time_command(argv: list[str], repeats: int) -> float:
    command = [sys.executable, "-m", "posttrain", *argv]
    subprocess.run(command, capture_output=True, check=True, timeout=300)  # warm the file cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True, timeout=300)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    seconds = {" ".join(argv): round(time_command(argv, args.repeats), 3) for argv in COMMANDS}
    slowest = max(seconds, key=seconds.get)
    print(json.dumps({
        "benchmark": "cli_startup", "repeats": args.repeats, "median_s": seconds,
        "slowest": {"command": slowest, "s": seconds[slowest]},
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
        "python": platform.python_version(), "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }))


if __name__ == "__main__":
    main()
