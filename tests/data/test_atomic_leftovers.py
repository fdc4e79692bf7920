"""What a killed writer leaves (``….tmp-<id>``) is removed by the next commit of the same target once it is
older than ``STALE_TEMP_S``; a younger one (a writer still under way) and other targets' files are kept."""

from __future__ import annotations

import os
import time

import fsspec

from posttrain.data import storage
from posttrain.data.io import read_records, write_jsonl

ROWS = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]


def test_a_local_commit_removes_a_dead_writers_temp_and_keeps_a_live_one(tmp_path):
    target = tmp_path / "train.jsonl"
    dead, live, other = (tmp_path / "train.jsonl.tmp-111-dead", tmp_path / "train.jsonl.tmp-222-live",
                         tmp_path / "eval.jsonl.tmp-333-dead")
    for path in (dead, live, other):
        path.write_text("half a record")
    old = time.time() - storage.STALE_TEMP_S - 60
    os.utime(dead, (old, old))
    os.utime(other, (old, old))
    write_jsonl(str(target), ROWS)
    assert not dead.exists() and live.exists() and other.exists()  # only this target's, and only the dead one
    assert len(read_records(str(target), kind="sft", progress=False)[0]) == 1


def test_an_s3_commit_removes_its_targets_leftovers_by_one_prefix_listing(s3_bucket, monkeypatch):
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    base = s3_bucket.removeprefix("s3://")
    for key in ("data/train.jsonl.tmp-1-dead", "data/train.jsonl.tmp-2-dead", "data/train2.jsonl",
                "data/eval.jsonl.tmp-3-dead"):
        fs.pipe_file(f"{base}/{key}", b"x")
    monkeypatch.setattr(storage, "STALE_TEMP_S", -60.0)  # moto stamps every key "now": make them all old
    write_jsonl(f"{s3_bucket}/data/train.jsonl", ROWS)
    fs.invalidate_cache()
    left = sorted(key.removeprefix(f"{base}/") for key in fs.find(f"{base}/data"))
    assert left == ["data/eval.jsonl.tmp-3-dead", "data/train.jsonl", "data/train2.jsonl"]
