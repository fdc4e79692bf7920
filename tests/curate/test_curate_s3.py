"""``posttrain curate`` reads shard sets from s3:// and writes its dataset there; the output reads back."""

from __future__ import annotations

import json

import fsspec

from posttrain.cli import main
from posttrain.curate.pipeline import curate
from posttrain.data.io import read_records
from tests.curate.conftest import LIGHT, make_config, read_jsonl


def test_curate_from_and_to_s3_equals_the_local_run(raw_pool_file, s3_bucket, tmp_path, capsys):
    lines = raw_pool_file.read_bytes().splitlines(keepends=True)
    for index, start in enumerate(range(0, len(lines), 100)):  # 3 shards, read back in name order
        with fsspec.open(f"{s3_bucket}/pool/part-{index:03d}.jsonl", "wb") as handle:
            handle.write(b"".join(lines[start:start + 100]))
    local = curate(make_config(raw_pool_file, tmp_path / "local"))
    out = f"{s3_bucket}/curated/round-1"
    assert main(["curate", f"data.input={s3_bucket}/pool/part-*.jsonl", f"output_dir={out}", *LIGHT]) == 0
    assert f"kept → {out}/kept.jsonl" in capsys.readouterr().out
    fs = fsspec.filesystem("s3")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(out, refresh=True)) == [
        "dropped.jsonl", "funnel.json", "kept.jsonl", "manifest.json"]
    manifest = json.loads(fs.cat_file(f"{out}/manifest.json"))
    assert manifest["config"]["output_dir"] == out and manifest["funnel"] == local["funnel"]
    assert [p["path"] for p in manifest["parents"]] == [f"{s3_bucket}/pool/part-{i:03d}.jsonl" for i in range(3)]
    kept, _ = read_records(f"{out}/kept.jsonl", kind="sft", progress=False)
    expected = read_jsonl(tmp_path / "local" / "kept.jsonl")
    assert [r.messages for r in kept] == [read_records_messages(row) for row in expected]
    # Into a bucket that does not exist: refused before any work, in one line.
    assert main(["curate", f"data.input={raw_pool_file}", "output_dir=s3://no-such-bucket-c1/x", *LIGHT]) == 2
    assert "the bucket 'no-such-bucket-c1' does not exist" in capsys.readouterr().err


def read_records_messages(row: dict) -> list:
    from posttrain.data.records import SFTExample

    return SFTExample(messages=row["messages"]).messages
