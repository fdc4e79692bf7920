"""RunStore and CheckpointUploader against moto's S3 server: what counts as a checkpoint, what comes down at
start, what is pruned, retries and the outage limit, and that an upload does not block its caller."""

from __future__ import annotations

import functools
import hashlib
import json
import time
import warnings
from pathlib import Path

import pytest

from posttrain.store import RunStore, StoreUnavailable
from posttrain.store.uploader import CheckpointUploader
from tests.cloud.faulty_proxy import FaultyProxy


def write_checkpoint(root: Path, step: int, files: dict[str, bytes]) -> Path:
    """A checkpoint directory as save_checkpoint leaves it: the files, then a manifest with sha256 and size."""
    directory = root / "checkpoints" / f"step-{step:06d}"
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    manifest = {"step": step, "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()},
                "sizes": {n: len(d) for n, d in files.items()}}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def upload(store: RunStore, directory: Path, with_manifest: bool = True) -> None:
    for path in sorted(directory.iterdir()):
        if with_manifest or path.name != "manifest.json":
            store.put_file(path, f"checkpoints/{directory.name}/{path.name}")


@functools.cache
def dcp_metadata() -> bytes:
    """A real DCP ``.metadata`` (one small tensor in ``__0_0.distcp``): a fetch reads it through the
    restricted unpickler before a checkpoint counts, so a stand-in string would make every checkpoint invalid."""
    import tempfile

    import torch
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save({"w": torch.zeros(4)}, checkpoint_id=directory, no_dist=True)
        return (Path(directory) / ".metadata").read_bytes()


def shards(step: int) -> dict[str, bytes]:
    trainer = {"next_step": step, "optimizer_steps": step, "rollbacks": 0, "skip": [], "source": {}}
    return {"__0_0.distcp": bytes([step]) * 5000, ".metadata": dcp_metadata(), "trainer.json": json.dumps(trainer).encode()}


def test_a_checkpoint_is_its_manifest_and_every_file_in_full(s3_bucket, tmp_path):
    store = RunStore(f"{s3_bucket}/run", local_dir=tmp_path / "mirror")
    upload(store, write_checkpoint(tmp_path / "src", 2, shards(2)))
    assert store.manifest(2)[0] is not None
    upload(store, write_checkpoint(tmp_path / "src", 4, shards(4)), with_manifest=False)
    assert store.manifest(4) == (None, "no manifest (the upload did not finish)")
    upload(store, write_checkpoint(tmp_path / "src", 6, shards(6)))
    store.write_bytes("checkpoints/step-000006/__0_0.distcp", b"cut short")
    assert store.manifest(6)[1] == "file __0_0.distcp has 9 of 5000 bytes"
    store.write_bytes("checkpoints/step-000006/__0_0.distcp", shards(6)["__0_0.distcp"])
    store.remove("checkpoints/step-000006/.metadata")
    assert store.manifest(6)[1] == "file .metadata missing"


def test_sync_down_fetches_the_newest_valid_checkpoint_and_drops_stale_local_state(s3_bucket, tmp_path):
    url = f"{s3_bucket}/run"
    source = RunStore(url, local_dir=tmp_path / "src")
    for step in (2, 4):
        upload(source, write_checkpoint(tmp_path / "src", step, shards(step)))
    # Step 4's shard rots in the store (same size, other bytes): its sha256 no longer matches.
    source.write_bytes("checkpoints/step-000004/__0_0.distcp", b"\x00" * 5000)
    source.write_bytes("metrics.jsonl", b'{"step": 0}\n')
    mirror = tmp_path / "mirror"
    write_checkpoint(mirror, 8, shards(8))  # left over from another run of this URL
    (mirror / "alerts.jsonl").parent.mkdir(parents=True, exist_ok=True)
    (mirror / "alerts.jsonl").write_text("stale\n")
    store = RunStore(url, local_dir=mirror)
    with pytest.warns(UserWarning, match="step-000004: checksum mismatch in __0_0.distcp"):
        fetched = store.sync_down()
    assert fetched is not None and fetched[0] == 2 and fetched[1]["step"] == 2
    assert sorted(p.name for p in (mirror / "checkpoints").iterdir()) == ["step-000002"]
    assert (mirror / "checkpoints/step-000002/__0_0.distcp").read_bytes() == shards(2)["__0_0.distcp"]
    assert (mirror / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert not (mirror / "alerts.jsonl").exists()


def test_prune_keeps_the_newest_committed_and_drops_failed_uploads(s3_bucket, tmp_path):
    store = RunStore(f"{s3_bucket}/run", local_dir=tmp_path / "mirror")
    for step, committed in ((2, True), (4, True), (6, False), (8, True), (10, True)):
        upload(store, write_checkpoint(tmp_path / "src", step, shards(step)), with_manifest=committed)
    store.prune(keep_last=2, committed=10)
    assert store.checkpoint_steps() == [10, 8]


def test_retries_back_off_then_the_outage_limit_raises(s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    with FaultyProxy(s3_endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        retried = []
        store = RunStore(f"{s3_bucket}/run", local_dir=tmp_path, backoff_s=0.1, max_outage_s=1.5,
                         on_retry=lambda what, error: retried.append(what))
        proxy.rules = [["PUT", "/run/flaky", ("status", 503), 3]]  # botocore retries once itself; 3 outlast that
        store.write_bytes("flaky", b"eventually")
        assert store.read_bytes("flaky") == b"eventually" and retried == ["writing flaky"]
        proxy.rules = [["PUT", "/run/down", ("status", 503), None]]
        # The waits, not the wall clock, are what RunStore decides (a loaded CI box makes every request slow):
        # each wait doubles from backoff_s, and no wait is begun that would end past the outage limit.
        waits, sleep = [], time.sleep
        monkeypatch.setattr(time, "sleep", lambda seconds: (waits.append(seconds), sleep(seconds))[1])
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="store.max_outage_s=1.5"):
            store.write_bytes("down", b"never")
        elapsed = time.monotonic() - started
        assert waits and waits == [0.1 * 2**i for i in range(len(waits))] and sum(waits) <= 1.5
        assert elapsed > 1.5 - waits[-1] * 2  # it kept trying until the next wait would pass the limit


def test_submit_returns_at_once_and_one_upload_is_in_flight(s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    with FaultyProxy(s3_endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.rules = [["PUT", "/checkpoints/", ("delay", 1.0), None]]  # ≥ 4 s per upload
        store = RunStore(f"{s3_bucket}/run", local_dir=tmp_path / "mirror")
        commits = []
        uploader = CheckpointUploader(store, rank=0, world=1, keep_last=2, attempt="t",
                                      alert=lambda *a, **k: None, on_commit=lambda *a: commits.append(a[0]))
        first = write_checkpoint(tmp_path / "mirror", 2, shards(2))
        started = time.monotonic()
        uploader.submit(2, first, ["__0_0.distcp", ".metadata", "trainer.json", "manifest.json"])
        assert time.monotonic() - started < 2.0 and commits == []  # the upload itself takes >= 4 s
        second = write_checkpoint(tmp_path / "mirror", 4, shards(4))
        waited = uploader.submit(4, second, ["__0_0.distcp", ".metadata", "trainer.json", "manifest.json"])
        assert waited > 2.0 and commits == [2]  # the second save waited for the first upload
        uploader.wait()
    assert commits == [2, 4] and store.manifest(4)[0] is not None


def test_torch_fsspec_writer_misses_a_dropped_shard_and_the_verified_writer_does_not(
        s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    """The failure mode the direct path guards against, shown: DCP's own FsspecWriter reports success for a
    shard the store dropped; save_direct finds the hole before writing a manifest."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from posttrain.store.direct import save_direct

    with FaultyProxy(s3_endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.rules = [["PUT", "__0_0.distcp", "blackhole", None]]
        store = RunStore(f"{s3_bucket}/run", local_dir=tmp_path, max_outage_s=2)
        state = {"w": torch.arange(1000, dtype=torch.float32)}
        dcp.save(state, storage_writer=FsspecWriter(f"{s3_bucket}/run/plain"), no_dist=True)  # "succeeds"
        assert store.size("plain/__0_0.distcp") is None  # …with the shard gone
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        problem = save_direct(store, 2, model, optimizer, {"next_step": 2}, {"config": {}})
    assert problem.startswith("__0_0.distcp: the store holds nothing of")
    assert store.manifest(2) == (None, "no manifest (the upload did not finish)")
