"""Run under torchrun: every rank reads a shard set with ``read_records(split_across_ranks=True)`` and writes
what it got, and which shards it parsed itself, to ``OUT/<i>-rank-<r>.json`` for the i-th SOURCE
(``shard_ranks.py SOURCE... OUT``; see test_s3_datasets.py)."""

import json
import sys

from posttrain import dist
from posttrain.data import io
from posttrain.exit_codes import exit_process

sources, out = sys.argv[1:-1], sys.argv[-1]
dist.init_distributed()
parsed = []
read_shard = io._read_shard
io._read_shard = lambda path, *args: parsed.append(path.rsplit("/", 1)[1]) or read_shard(path, *args)
for number, source in enumerate(sources):
    parsed.clear()
    try:
        records, report = io.read_records(source, kind="sft", progress=False, split_across_ranks=True)
        result = {"records": [r.messages[0].content for r in records], "read": report.read}
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's error
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["parsed"] = list(parsed)
    with open(f"{out}/{number}-rank-{dist.rank()}.json", "w") as handle:
        json.dump(result, handle)
dist.destroy()
exit_process(0)
