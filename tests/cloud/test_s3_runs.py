"""Training runs whose output_dir is an s3:// URL, against moto's S3 server on loopback, some through a proxy
that injects faults: resume on a fresh machine, failed and dropped uploads, a store that stays down."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import s3fs
import torch
from safetensors.torch import load

from posttrain.store import RunStore
from tests.cloud.faulty_proxy import FaultyProxy
from tests.train.conftest import (
    ROOT,
    base_overrides,
    env,
    final_weights,
    run_subprocess,
    sft_command,
)

pytestmark = pytest.mark.slow


def s3_env(endpoint: str, **extra: str) -> dict[str, str]:
    result = env()
    result["AWS_ENDPOINT_URL"] = endpoint
    result.update(extra)
    return result


def run_sft(overrides: list[str], endpoint: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(sft_command(overrides), cwd=ROOT, env=s3_env(endpoint), capture_output=True, text=True,
                          timeout=timeout)


def remote_final(url: str) -> dict[str, torch.Tensor]:
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    return load(fs.cat_file(url.removeprefix("s3://") + "/final/model.safetensors"))


def remote_alerts(url: str) -> list[dict]:
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    text = fs.cat_file(url.removeprefix("s3://") + "/alerts.jsonl").decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, sft_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "run"
    result = run_subprocess(base_overrides(tiny_model_dir, sft_data, out, **{"train.save_every": 2}))
    assert result.returncode == 0, result.stderr[-2000:]
    return final_weights(out)


def test_fresh_machine_resumes_from_s3_bit_identical(tiny_model_dir, sft_data, uninterrupted, s3_bucket,
                                                     s3_endpoint, tmp_path):
    url, mirror = f"{s3_bucket}/run", tmp_path / "mirror"
    overrides = base_overrides(tiny_model_dir, sft_data, url, **{"train.save_every": 2, "store.local_dir": mirror})
    crashed = run_sft([*overrides, "debug.crash_at_step=4"], s3_endpoint)
    assert crashed.returncode == -9, crashed.stderr[-2000:]  # SIGKILL: a node lost mid-run
    committed = RunStore(url).checkpoint_steps()
    assert committed, "nothing reached the store before the kill"
    shutil.rmtree(mirror)  # a fresh machine: nothing of the run on local disk
    resumed = run_sft(overrides, s3_endpoint)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step" in resumed.stderr
    assert same(remote_final(url), uninterrupted)
    kinds = [event["kind"] for event in remote_alerts(url)]
    assert "resumed" in kinds and "checkpoint_uploaded" in kinds
    rerun = run_sft(overrides, s3_endpoint)  # finished.json in the store: nothing to do
    assert rerun.returncode == 0 and "holds a finished run" in rerun.stderr


def test_a_silently_dropped_shard_never_commits_and_the_store_outage_exits_75(
        tiny_model_dir, sft_data, uninterrupted, s3_bucket, s3_endpoint, tmp_path):
    url, mirror = f"{s3_bucket}/run", tmp_path / "mirror"
    overrides = base_overrides(tiny_model_dir, sft_data, url, **{
        "train.save_every": 2, "store.local_dir": mirror, "store.backoff_s": 0.2, "store.max_outage_s": 3})
    with FaultyProxy(s3_endpoint) as proxy:
        # The store answers 200 to every PUT of step 4's model shard and keeps nothing (pytorch#183878's
        # symptom: a write reported done that never reached the store).
        proxy.rules = [["PUT", "step-000004/__0_0.distcp", "blackhole", None]]
        failed = run_sft(overrides, proxy.endpoint)
        assert proxy.seen[("PUT", "blackhole")] >= 2, (proxy.seen, failed.stderr[-3000:])  # retried
    assert failed.returncode == 75, failed.stderr[-2000:]
    assert "store.max_outage_s" in failed.stderr
    store = RunStore(url)
    manifest, problem = store.manifest(4)
    assert manifest is None and "manifest" in problem  # the dropped shard kept step 4 uncommitted
    assert store.manifest(2)[0] is not None  # the previous checkpoint is still valid
    local_alerts = [json.loads(line) for line in (mirror / "alerts.jsonl").read_text().splitlines()]
    assert {"store_unavailable", "stopped_store_unavailable"} <= {event["kind"] for event in local_alerts}
    shutil.rmtree(mirror)
    resumed = run_sft(overrides, s3_endpoint)  # the store is healthy again
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step 2" in resumed.stderr
    assert same(remote_final(url), uninterrupted)


def test_5xx_and_dropped_connections_are_retried(tiny_model_dir, sft_data, uninterrupted, s3_bucket, s3_endpoint,
                                                tmp_path):
    url = f"{s3_bucket}/run"
    overrides = base_overrides(tiny_model_dir, sft_data, url, **{
        "train.save_every": 2, "store.local_dir": tmp_path / "mirror", "store.backoff_s": 0.1})
    with FaultyProxy(s3_endpoint) as proxy:
        proxy.rules = [["PUT", "step-000002/__0_0.distcp", ("status", 503), 6],
                       ["PUT", "step-000004/__0_0.distcp", "drop", 3],
                       ["PUT", "manifest.json", ("status", 500), 2]]
        result = run_sft(overrides, proxy.endpoint)
        faults = proxy.seen[("PUT", "status")] + proxy.seen[("PUT", "drop")]
    assert result.returncode == 0, result.stderr[-2000:]
    assert faults == 11  # every injected fault was hit, and each was retried past
    store = RunStore(url)
    assert store.checkpoint_steps() == [6, 4]  # keep_last=2 committed checkpoints, older pruned
    assert all(store.manifest(step)[0] is not None for step in (6, 4))
    assert same(remote_final(url), uninterrupted)


def test_background_upload_overlaps_training(tiny_model_dir, sft_data, s3_bucket, s3_endpoint, tmp_path):
    """A slow store: steps go on while a checkpoint uploads (metrics.jsonl grows before the upload commits)."""
    url, mirror = f"{s3_bucket}/run", tmp_path / "mirror"
    overrides = base_overrides(tiny_model_dir, sft_data, url, **{
        "train.save_every": 2, "train.max_steps": 12, "store.local_dir": mirror})
    with FaultyProxy(s3_endpoint) as proxy:
        proxy.rules = [["PUT", "step-000002/", ("delay", 1.5), None]]
        result = run_sft(overrides, proxy.endpoint)
    assert result.returncode == 0, result.stderr[-2000:]
    events = [json.loads(line) for line in (mirror / "alerts.jsonl").read_text().splitlines()]
    upload = next(event for event in events if event["kind"] == "checkpoint_uploaded" and event["step"] == 2)
    assert upload["seconds"] >= 1.5 * 4  # 4 files + the manifest went through the slow proxy
    step_times = [json.loads(line)["step_time_s"] for line in (mirror / "metrics.jsonl").read_text().splitlines()
                  if '"step_time_s"' in line]
    # The steps after the save did not wait for the 6+ s upload (the next save, at step 4, did).
    assert sum(step_times[2:4]) < 1.5, step_times


def test_a_missing_bucket_is_one_clear_line(tiny_model_dir, sft_data, s3_endpoint, tmp_path):
    result = run_sft(base_overrides(tiny_model_dir, sft_data, "s3://no-such-bucket-posttrain/run",
                                    **{"store.local_dir": tmp_path / "m", "store.max_outage_s": 2}), s3_endpoint)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("posttrain:") and "no-such-bucket-posttrain" in last, result.stderr[-1500:]
    assert "Traceback" not in result.stderr



def test_two_ranks_upload_their_own_shards_and_resume_bit_identical(tiny_model_dir, sft_data, s3_bucket,
                                                                    s3_endpoint, tmp_path):
    common = {"train.save_every": 2, "train.batch_size": 2, "train.global_batch_size": 4}
    clean = tmp_path / "clean"
    proc = run_subprocess(base_overrides(tiny_model_dir, sft_data, clean, **common), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    url, mirror = f"{s3_bucket}/run", tmp_path / "mirror"
    overrides = base_overrides(tiny_model_dir, sft_data, url, **common, **{"store.local_dir": mirror})
    command = sft_command([*overrides, "debug.crash_at_step=4"], nproc=2)
    crashed = subprocess.run(command, cwd=ROOT, env=s3_env(s3_endpoint), capture_output=True, text=True, timeout=300)
    assert crashed.returncode != 0
    store = RunStore(url)
    step = next(s for s in store.checkpoint_steps() if store.manifest(s)[0] is not None)
    manifest = store.manifest(step)[0]
    assert {"__0_0.distcp", "__1_0.distcp", "rng-rank0.json", "rng-rank1.json"} <= set(manifest["files"])
    assert not [name for name in store.listdir(f"checkpoints/step-{step:06d}") if name.startswith(".uploaded")]
    shutil.rmtree(mirror)
    resumed = subprocess.run(sft_command(overrides, nproc=2), cwd=ROOT, env=s3_env(s3_endpoint),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step {step}" in resumed.stderr
    assert same(remote_final(url), final_weights(clean))
    # Markers are removed before the manifest: no committed checkpoint holds one, whenever the crash landed.
    store = RunStore(url)
    for kept in store.checkpoint_steps():
        assert store.manifest(kept)[0] is not None
        assert not [name for name in store.listdir(f"checkpoints/step-{kept:06d}") if name.startswith(".uploaded")]


def test_direct_mode_writes_through_dcp_and_a_dropped_shard_is_never_committed(
        tiny_model_dir, sft_data, uninterrupted, s3_bucket, s3_endpoint, tmp_path):
    """store.upload=direct: DCP's fsspec writer streams into the store. The store silently drops step 4's
    model shard (200, nothing kept): the size check refuses to commit it, the run goes on, and a kill plus a
    fresh machine resumes from a committed step with bit-identical final weights."""
    url, mirror = f"{s3_bucket}/run", tmp_path / "mirror"
    overrides = base_overrides(tiny_model_dir, sft_data, url, **{
        "train.save_every": 2, "store.local_dir": mirror, "store.upload": "direct"})
    with FaultyProxy(s3_endpoint) as proxy:
        proxy.rules = [["PUT", "step-000004/__0_0.distcp", "blackhole", 1]]
        crashed = run_sft([*overrides, "debug.crash_at_step=4"], proxy.endpoint)
        assert proxy.seen[("PUT", "blackhole")] == 1
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    assert "did not reach" in crashed.stderr and "__0_0.distcp" in crashed.stderr
    store = RunStore(url)
    assert store.manifest(4)[0] is None and store.manifest(2)[0] is not None
    assert not (mirror / "checkpoints").exists() or not any((mirror / "checkpoints").iterdir())
    shutil.rmtree(mirror)
    resumed = run_sft(overrides, s3_endpoint)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step 2" in resumed.stderr
    assert same(remote_final(url), uninterrupted)


def test_quarantine_goes_up_with_the_run_and_resume_never_moves_the_store_run_aside(
        tiny_model_dir, sft_data, s3_bucket, s3_endpoint, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(open(sft_data).read() + "{not json\n")
    url = f"{s3_bucket}/run"
    overrides = base_overrides(tiny_model_dir, str(data), url, **{
        "store.local_dir": tmp_path / "mirror", "data.on_error": "quarantine", "train.max_steps": 2})
    first = run_sft(overrides, s3_endpoint)
    assert first.returncode == 0, first.stderr[-2000:]
    store = RunStore(url)
    assert b"not json" in store.read_bytes("quarantine.jsonl")
    again = run_sft([*overrides, "train.resume=never"], s3_endpoint)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "the previous run was moved to s3://" in again.stderr
    previous = [name for name in store.listdir("") if name.startswith("previous-")]
    assert len(previous) == 1
    assert store.read_bytes(f"{previous[0]}/finished.json") is not None
    assert store.read_bytes("finished.json") is not None  # the new run finished too


def test_direct_mode_stops_with_75_when_the_store_stays_down(tiny_model_dir, sft_data, s3_bucket, s3_endpoint,
                                                              tmp_path):
    url = f"{s3_bucket}/run"
    overrides = base_overrides(tiny_model_dir, sft_data, url, **{
        "train.save_every": 2, "store.local_dir": tmp_path / "mirror", "store.upload": "direct",
        "store.backoff_s": 0.2, "store.max_outage_s": 2})
    with FaultyProxy(s3_endpoint) as proxy:
        proxy.rules = [["PUT", "step-000004/", ("status", 503), None]]
        result = run_sft(overrides, proxy.endpoint)
    assert result.returncode == 75, result.stderr[-2000:]
    assert "store.max_outage_s" in result.stderr
    store = RunStore(url)
    assert store.manifest(2)[0] is not None and store.manifest(4)[0] is None
