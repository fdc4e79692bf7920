"""Two ranks under torchrun: rank 0 serves both ranks' heartbeats and the timed all-reduce."""

from __future__ import annotations

import time

import pytest

from tests.telemetry.conftest import run_and_scrape
from tests.train.conftest import base_overrides


@pytest.mark.slow
def test_rank_0_exports_a_heartbeat_for_each_rank_and_the_all_reduce_latency(tiny_model_dir, sft_data, tmp_path):
    started = time.time()
    scraped = run_and_scrape(base_overrides(tiny_model_dir, sft_data, tmp_path / "run", **{
        "train.max_steps": 3, "train.global_batch_size": 4, "train.batch_size": 2,
        "metrics.allreduce_probe_every": 1}), nproc=2)
    assert scraped.returncode == 0, scraped.stderr[-3000:]
    assert scraped.stderr.count("Prometheus /metrics on") == 1  # rank 0 only
    heartbeats = {labels: value for (name, labels), value in scraped.samples().items()
                  if name == "posttrain_heartbeat_timestamp_seconds"}
    assert sorted(heartbeats) == [(("rank", "0"),), (("rank", "1"),)]
    assert all(started < value < time.time() for value in heartbeats.values())
    assert scraped.value("posttrain_world_size") == 2 and scraped.value("posttrain_steps_total") == 3
    assert 0 < scraped.value("posttrain_allreduce_latency_seconds") < 10
