"""Per-item cost of the code verifier: one sandboxed run of a correct solution and its tests, end to end
(``posttrain.eval.verifiers.verify``), one item at a time, and a harness-style batch on two threads.

A suite's eval runs hundreds of code items, so the fixed cost of building the jail and starting the
interpreter is what this measures: the solution and tests are trivial. Printed: one JSON line with the
median and mean wall seconds per item (sequential), the CPU seconds per item of all the processes a run
starts (less sensitive than wall time to other jobs on a shared machine), items per second with
``--workers`` threads, and the 1-minute load average before and after (re-run on a quiet machine before
quoting a wall-clock figure):

    .venv/bin/python benchmarks/sandbox_overhead.py            # defaults: --items 40 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from posttrain.eval.items import EvalItem
from posttrain.eval.sandbox import sandbox_support
from posttrain.eval.verifiers import verify

ITEM = EvalItem(id="bench-add", prompt="write add", verifier="code", group="code",
                tests="result = add(2, 3)\nassert type(result) is int and result == 5")
OUTPUT = "```python\ndef add(a, b):\n    return a + b\n```"


def one_item() -> float:
    start = time.perf_counter()
    result = verify(ITEM, OUTPUT)
    elapsed = time.perf_counter() - start
    if not result.passed:
        raise SystemExit(f"the benchmark item failed: {result.detail}")
    return elapsed


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every reaped descendant: jail, runner, solution
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    supported, how = sandbox_support()
    if not supported:
        raise SystemExit(f"the sandbox does not work here: {how}")
    load_before = os.getloadavg()[0]
    one_item()  # warm the file cache
    cpu_before = _children_cpu_s()
    times = [one_item() for _ in range(args.items)]
    cpu_per_item = (_children_cpu_s() - cpu_before) / args.items
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        list(pool.map(lambda _: one_item(), range(args.items)))
    batch_s = time.perf_counter() - start
    print(json.dumps({
        "benchmark": "sandbox_overhead",
        "items": args.items,
        "median_s_per_item": round(statistics.median(times), 4),
        "mean_s_per_item": round(statistics.fmean(times), 4),
        "cpu_s_per_item": round(cpu_per_item, 4),
        "workers": args.workers,
        "items_per_s_with_workers": round(args.items / batch_s, 2),
        "sandbox": how,
        "load_1m_before": round(load_before, 2),
        "load_1m_after": round(os.getloadavg()[0], 2),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }))


if __name__ == "__main__":
    main()
