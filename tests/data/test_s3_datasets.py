"""Datasets in object storage: every recipe reads s3:// data (files and shard sets), writes are all or
nothing, the run identity sees a changed shard, and a missing bucket, credentials or s3fs is one clear line.

All against the loopback S3 server (``s3_endpoint`` / ``s3_bucket`` in tests/conftest.py)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import fsspec
import pytest
import torch

from posttrain.data.errors import DataError
from posttrain.data.io import jsonl_writer, read_records, write_jsonl, write_records
from posttrain.data.records import SFTExample
from posttrain.data.shards import list_shards
from posttrain.data.storage import StorageUnavailable, source_fingerprint
from tests.train.conftest import ROOT, base_overrides, env, final_weights, make_sft_jsonl, read_jsonl


def put(url: str, data: bytes) -> str:
    with fsspec.open(url, "wb") as handle:
        handle.write(data)
    return url


def lines(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def sft_rows(n: int, start: int = 0) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(start, start + n)]


def cli(*argv: str) -> int:
    from posttrain.cli import main

    return main(list(argv))


# ------------------------------------------------------------------------------------------ reading


def test_jsonl_gz_and_parquet_round_trip_through_s3(s3_bucket):
    records = [SFTExample(messages=row["messages"]) for row in sft_rows(5)]
    for name in ("a.jsonl", "a.jsonl.gz", "a.parquet"):
        write_records(f"{s3_bucket}/out/{name}", records)
        back, report = read_records(f"{s3_bucket}/out/{name}", kind="sft", progress=False)
        assert [r.messages for r in back] == [r.messages for r in records] and report.accepted == 5, name
    raw = fsspec.open(f"{s3_bucket}/out/a.jsonl.gz", "rb").open().read()
    assert gzip.decompress(raw).count(b"\n") == 5  # really compressed
    fs = fsspec.filesystem("s3")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{s3_bucket}/out", refresh=True)) == [
        "a.jsonl", "a.jsonl.gz", "a.parquet"]  # no temporary key left behind


def test_a_parquet_shard_set_is_read_in_name_order_and_errors_name_the_shard(s3_bucket):
    # Written out of order; names sort as 0, 1, 2 (10 before 2 would be wrong: zero-padded names).
    for index in (2, 0, 1):
        rows = [SFTExample(messages=row["messages"]) for row in sft_rows(3, start=10 * index)]
        write_records(f"{s3_bucket}/data/train-{index:05d}.parquet", rows)
    put(f"{s3_bucket}/data/_SUCCESS", b"")
    for source in (f"{s3_bucket}/data/train-*.parquet", f"{s3_bucket}/data", f"{s3_bucket}/data/"):
        records, report = read_records(source, kind="sft", progress=False)
        assert [r.messages[0].content for r in records] == [f"question {i}" for i in (0, 1, 2, 10, 11, 12, 20, 21, 22)]
        assert report.read == 9 and report.path == source
    # A bad record in the second shard: the error names that shard and its row.
    put(f"{s3_bucket}/mixed/part-0.jsonl", lines(sft_rows(2)))
    put(f"{s3_bucket}/mixed/part-1.jsonl", lines(sft_rows(1)) + b'{"messages": []}\n')
    with pytest.raises(DataError, match=r"mixed/part-1\.jsonl:2: `messages`"):
        read_records(f"{s3_bucket}/mixed", kind="sft", progress=False)
    records, report = read_records(f"{s3_bucket}/mixed", kind="sft", on_error="quarantine",
                                   quarantine_path=f"{s3_bucket}/q.jsonl", progress=False)
    assert len(records) == 3 and report.quarantined == 1
    assert list(report.example_lines.values()) == [["part-1.jsonl:2"]]
    (entry,) = [json.loads(line) for line in fsspec.open(f"{s3_bucket}/q.jsonl", "rt").open()]
    assert entry["file"] == f"{s3_bucket}/mixed/part-1.jsonl" and entry["line"] == 2


def test_the_fingerprint_changes_when_one_shard_changes_and_not_when_the_set_moves(s3_bucket):
    for index in range(3):
        put(f"{s3_bucket}/v1/s-{index}.jsonl", lines(sft_rows(2, start=index)))
    before = source_fingerprint(f"{s3_bucket}/v1")
    assert before["files"] == 3 and sorted(before["per_file"]) == ["s-0.jsonl", "s-1.jsonl", "s-2.jsonl"]
    fsspec.filesystem("s3").copy(f"{s3_bucket}/v1", f"{s3_bucket}/v2", recursive=True)
    assert source_fingerprint(f"{s3_bucket}/v2/s-*.jsonl")["digest"] == before["digest"]  # same bytes, same names
    put(f"{s3_bucket}/v1/s-1.jsonl", lines(sft_rows(2, start=7)))  # same size, other content
    after = source_fingerprint(f"{s3_bucket}/v1")
    assert after["digest"] != before["digest"]
    assert [n for n in before["per_file"] if before["per_file"][n] != after["per_file"][n]] == ["s-1.jsonl"]


# ------------------------------------------------------------------------------------------ writing


def test_a_failed_write_leaves_nothing_and_a_missing_bucket_is_refused(s3_bucket, s3_endpoint):
    url = f"{s3_bucket}/half.jsonl"
    with pytest.raises(RuntimeError, match="boom"), jsonl_writer(url) as out:
        out.write({"a": 1})
        raise RuntimeError("boom")
    fs = fsspec.filesystem("s3")
    assert not fs.exists(url) and fs.ls(s3_bucket, refresh=True) == []
    write_jsonl(url, [{"a": 1}])
    with pytest.raises(RuntimeError), jsonl_writer(url) as out:  # a failed rewrite keeps the old file
        out.write({"a": 2})
        raise RuntimeError("boom")
    assert fsspec.open(url, "rt").open().read() == '{"a": 1}\n'
    with pytest.raises(FileNotFoundError, match=r"s3://no-such-bucket-x1/a\.jsonl: the bucket 'no-such-bucket-x1' "
                                                r"does not exist"):
        write_jsonl("s3://no-such-bucket-x1/a.jsonl", [{"a": 1}])
    assert not fs.exists("no-such-bucket-x1")  # s3fs would have created it


def test_data_tasks_writes_to_s3_and_missing_inputs_are_one_line(s3_bucket, capsys):
    assert cli("data", "tasks", "rl", f"{s3_bucket}/tasks/rl.jsonl", "-n", "6") == 0
    records, _ = read_records(f"{s3_bucket}/tasks/rl.jsonl", kind="rl", progress=False)
    assert len(records) == 6
    assert "wrote 6 rl records" in capsys.readouterr().err
    assert cli("data", "inspect", "s3://no-such-bucket-x2/train.jsonl") == 2
    err = capsys.readouterr().err.strip()
    assert err == "posttrain: s3://no-such-bucket-x2/train.jsonl: the bucket 'no-such-bucket-x2' does not exist " \
                  f"(endpoint {os.environ['AWS_ENDPOINT_URL']}, from AWS_ENDPOINT_URL)"
    assert cli("data", "inspect", f"{s3_bucket}/none/*.jsonl") == 2
    assert "no file matches this pattern" in capsys.readouterr().err


def test_missing_credentials_exit_1_in_one_line(s3_bucket, tmp_path):
    put(f"{s3_bucket}/train.jsonl", lines(sft_rows(2)))
    child = {key: value for key, value in env().items() if not key.startswith("AWS_ACCESS_KEY") and
             not key.startswith("AWS_SECRET")}
    child.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
                 AWS_EC2_METADATA_DISABLED="true")
    proc = subprocess.run([sys.executable, "-m", "posttrain", "data", "inspect", f"{s3_bucket}/train.jsonl"],
                          cwd=ROOT, env=child, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"posttrain: {s3_bucket}/train.jsonl: no usable credentials for s3://")
    assert "AWS_ACCESS_KEY_ID" in line and "Traceback" not in proc.stderr


def test_without_s3fs_the_error_names_the_url_and_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # `import s3fs` now fails, as when it is not installed
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)
    with pytest.raises(StorageUnavailable, match=r"s3://b/train\.jsonl: s3:// URLs need s3fs, which is not "
                                                 r"installed: pip install 'posttrain\[s3\]'"):
        read_records("s3://b/train.jsonl")
    assert cli("data", "inspect", "s3://b/train.jsonl") == 2
    assert "pip install 'posttrain[s3]'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ recipes


def test_sft_from_an_s3_shard_set_equals_sft_from_the_local_file(tiny_model_dir, s3_bucket, tmp_path):
    local = make_sft_jsonl(tmp_path / "train.jsonl", n=24)
    rows = local.read_bytes().splitlines(keepends=True)
    for index, start in enumerate(range(0, 24, 8)):
        name = f"train-{index:05d}.jsonl" + (".gz" if index == 1 else "")
        data = b"".join(rows[start:start + 8])
        put(f"{s3_bucket}/sft/{name}", gzip.compress(data) if name.endswith(".gz") else data)
    common = {"train.max_steps": 2, "data.shuffle": "false"}
    assert cli("sft", *base_overrides(tiny_model_dir, str(local), tmp_path / "local", **common)) == 0
    assert cli("sft", *base_overrides(tiny_model_dir, f"{s3_bucket}/sft", tmp_path / "s3", **common)) == 0
    a, b = final_weights(tmp_path / "local"), final_weights(tmp_path / "s3")
    assert all(torch.equal(a[key], b[key]) for key in a)
    steps = [m["step"] for m in read_jsonl(tmp_path / "s3" / "metrics.jsonl") if "loss" in m]
    assert steps == [0, 1]


def test_resume_refuses_when_a_shard_changed(tiny_model_dir, s3_bucket, tmp_path, capsys):
    rows = make_sft_jsonl(tmp_path / "train.jsonl", n=16).read_bytes().splitlines(keepends=True)
    put(f"{s3_bucket}/r/a.jsonl", b"".join(rows[:8]))
    put(f"{s3_bucket}/r/b.jsonl", b"".join(rows[8:]))
    out = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, f"{s3_bucket}/r/*.jsonl", out,
                               **{"train.max_steps": 4, "train.save_every": 2})
    killed = subprocess.run([sys.executable, "-m", "posttrain", "sft", *overrides, "debug.crash_at_step=3"],
                            cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert killed.returncode < 0 and (out / "checkpoints" / "step-000002").exists(), killed.stderr[-2000:]
    put(f"{s3_bucket}/r/b.jsonl", b"".join(rows[8:][::-1]))  # the same records in another order
    assert cli("sft", *overrides) == 2
    err = capsys.readouterr().err
    assert "other data than data.train=" in err and "changed: b.jsonl" in err and "Traceback" not in err
    assert not (out / "final").exists()
    put(f"{s3_bucket}/r/b.jsonl", b"".join(rows[8:]))  # restored: the run resumes and finishes
    assert cli("sft", *overrides) == 0
    assert "resuming from step 2" in capsys.readouterr().err


def test_pretrain_dpo_rm_and_grpo_read_s3_data(tiny_model_dir, s3_bucket, tmp_path):
    from tests.rl.conftest import grpo_overrides
    from tests.train_preference.conftest import dpo_overrides, preference_rows, rm_overrides

    texts = [{"text": f"Document {i}: the answer is {i * 7}."} for i in range(16)]
    put(f"{s3_bucket}/pt/a.jsonl", lines(texts[:8]))
    put(f"{s3_bucket}/pt/b.txt", "".join(t["text"] + "\n" for t in texts[8:]).encode())
    steps = {"train.max_steps": 1}
    assert cli("pretrain", *base_overrides(tiny_model_dir, f"{s3_bucket}/pt", tmp_path / "pt", **steps,
                                           **{"train.warmup_steps": 0})) == 0
    pairs = preference_rows(32, seed=1)
    write_records(f"{s3_bucket}/pref/train.parquet",
                  read_records_from_rows(pairs, tmp_path / "pairs.jsonl", "preference"))
    pref = {"train": f"{s3_bucket}/pref/train.parquet"}
    assert cli("dpo", *dpo_overrides(tiny_model_dir, pref, tmp_path / "dpo", **steps)) == 0
    assert cli("rm", *rm_overrides(tiny_model_dir, pref, tmp_path / "rm", **steps)) == 0
    assert cli("data", "tasks", "rl", f"{s3_bucket}/rl/prompts.jsonl.gz", "-n", "8", "--group", "reasoning") == 0
    assert cli("grpo", *grpo_overrides(tiny_model_dir, f"{s3_bucket}/rl/prompts.jsonl.gz", tmp_path / "grpo",
                                       **steps)) == 0
    for run in ("pt", "dpo", "rm", "grpo"):
        assert [m["step"] for m in read_jsonl(tmp_path / run / "metrics.jsonl") if "loss" in m] == [0], run
        assert (tmp_path / run / "finished.json").exists(), run


def read_records_from_rows(rows: list[dict], path, kind: str):
    path.write_bytes(lines(rows))
    return read_records(str(path), kind=kind, progress=False)[0]


@pytest.mark.slow
def test_two_ranks_split_the_shards_and_share_one_order_and_one_error(s3_bucket, tmp_path):
    for index in range(5):
        put(f"{s3_bucket}/split/part-{index}.jsonl", lines(sft_rows(2, start=10 * index)))
    put(f"{s3_bucket}/bad/part-0.jsonl", lines(sft_rows(1)))
    put(f"{s3_bucket}/bad/part-1.jsonl", b"not json\n")
    put(f"{s3_bucket}/bad/part-2.jsonl", lines(sft_rows(1)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "tests" / "data" / "shard_ranks.py"), f"{s3_bucket}/split", f"{s3_bucket}/bad", str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {name: [json.loads((tmp_path / f"{number}-rank-{r}.json").read_text()) for r in (0, 1)]
               for number, name in enumerate(("split", "bad"))}
    zero, one = results["split"]
    assert zero["parsed"] == ["part-0.jsonl", "part-2.jsonl", "part-4.jsonl"]
    assert one["parsed"] == ["part-1.jsonl", "part-3.jsonl"]
    expected = [f"question {i}" for i in (0, 1, 10, 11, 20, 21, 30, 31, 40, 41)]
    assert zero["records"] == one["records"] == expected and zero["read"] == one["read"] == 10
    # A bad line in rank 1's shard stops both ranks with the same error naming that shard's line.
    errors = [result["error"] for result in results["bad"]]
    assert errors[0] == errors[1] and errors[0].startswith(f"DataError: {s3_bucket}/bad/part-1.jsonl:1: ")


@pytest.mark.slow
def test_two_ranks_reading_s3_shards_equal_one_rank(tiny_model_dir, s3_bucket, tmp_path):
    rows = make_sft_jsonl(tmp_path / "train.jsonl", n=32).read_bytes().splitlines(keepends=True)
    for index in range(4):
        put(f"{s3_bucket}/ranks/part-{index}.jsonl", b"".join(rows[8 * index:8 * index + 8]))
    assert len(list_shards(f"{s3_bucket}/ranks")) == 4
    common = {"train.max_steps": 2, "train.max_grad_norm": "null", "data.shuffle": "false",
              "train.global_batch_size": 8, "debug.log_unit_ids": "true"}
    one, two = tmp_path / "one", tmp_path / "two"
    data = f"{s3_bucket}/ranks"
    assert cli("sft", *base_overrides(tiny_model_dir, data, one, **common, **{"train.batch_size": 8})) == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "posttrain", "sft", *base_overrides(tiny_model_dir, data, two, **common, **{"train.batch_size": 4})]
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    units = {}
    for out in (one, two):
        units[out.name] = {}
        for row in read_jsonl(out / "units.jsonl"):
            units[out.name].setdefault(row["step"], []).extend(row["ids"])
    assert {s: sorted(ids) for s, ids in units["one"].items()} == {s: sorted(ids) for s, ids in units["two"].items()}
    loss = {out.name: [m["loss"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m] for out in (one, two)}
    assert loss["two"] == pytest.approx(loss["one"], rel=1e-4)
