"""Two torchrun agents on one machine as two *nodes* (each its own local disk: its own mirror of the s3 run),
joined through the standalone rendezvous store the Kubernetes coordinator runs. Each node uploads only the
shards its rank wrote, a health-guard rollback fetches the committed checkpoint onto both nodes, and after a
SIGKILL both nodes start fresh, fetch from the store and finish bit-identical to a one-agent 2-rank run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from posttrain.serve.pg_local import free_port
from posttrain.store import RunStore
from tests.cloud.test_s3_runs import remote_final, s3_env, same
from tests.train.conftest import ROOT, base_overrides, final_weights, run_subprocess

pytestmark = pytest.mark.slow


def two_nodes(overrides: list[str], endpoint: str, caches: list, run_id: str) -> list[subprocess.CompletedProcess]:
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "posttrain.k8s.store", "--host", "127.0.0.1", "--port", str(port)],
                             stderr=subprocess.PIPE, env=s3_env(endpoint))
    try:
        assert b"listening" in store.stderr.readline()
        agents = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
             "--rdzv-conf", "is_host=false", "-m", "posttrain", "sft", *overrides],
            cwd=ROOT, env=s3_env(endpoint, XDG_CACHE_HOME=str(cache)), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True) for cache in caches]
        results = []
        for agent in agents:
            _, err = agent.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(agent.args, agent.returncode, "", err))
        return results
    finally:
        store.send_signal(signal.SIGTERM)
        try:
            store.wait(timeout=30)
        except subprocess.TimeoutExpired:
            store.kill()


def test_two_nodes_own_mirrors_rollback_and_fresh_resume(tiny_model_dir, sft_data, s3_bucket, s3_endpoint, tmp_path):
    common = {"train.save_every": 2, "train.batch_size": 2, "train.global_batch_size": 4,
              "debug.nan_steps": "[4,5,6]", "train.max_steps": 10}
    clean = tmp_path / "clean"
    proc = run_subprocess(base_overrides(tiny_model_dir, sft_data, clean, **common), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    url = f"{s3_bucket}/run"
    overrides = base_overrides(tiny_model_dir, sft_data, url, **common)
    caches = [tmp_path / "node0", tmp_path / "node1"]
    crashed = two_nodes([*overrides, "debug.crash_at_step=7"], s3_endpoint, caches, "first")
    assert all(result.returncode != 0 for result in crashed)
    events = [json.loads(line) for cache in caches for path in cache.rglob("alerts.jsonl")
              for line in path.read_text().splitlines()]
    assert "rollback" in [event["kind"] for event in events]  # both nodes went back to the committed step
    store = RunStore(url)
    assert store.manifest(6)[0] is not None  # committed before the rollback at step 6, which went back to it
    full = {"__0_0.distcp", "__1_0.distcp", ".metadata", "rng-rank0.json", "rng-rank1.json", "manifest.json"}
    for cache in caches:  # the rollback fetched the committed checkpoint onto both nodes' own disks
        assert full <= {p.name for p in next(cache.rglob("step-000006")).iterdir()}
    # The save at step 8 (the kill came right after it) is on each node's disk as its rank wrote it.
    on_disk = [{p.name for p in next(cache.rglob("step-000008")).iterdir()} for cache in caches]
    assert sorted("__1_0.distcp" in names and "__0_0.distcp" not in names for names in on_disk) == [False, True]
    step = next(s for s in store.checkpoint_steps() if store.manifest(s)[0] is not None)
    for cache in caches:  # fresh machines
        subprocess.run(["rm", "-rf", str(cache)], check=True)
    started = time.monotonic()
    resumed = two_nodes(overrides, s3_endpoint, caches, "second")
    assert [result.returncode for result in resumed] == [0, 0], [r.stderr[-2000:] for r in resumed]
    assert any(f"resuming from step {step}" in result.stderr for result in resumed)
    assert same(remote_final(url), final_weights(clean))
    assert time.monotonic() - started < 300
    assert os.path.isdir(caches[1])  # node 1 fetched into its own mirror
