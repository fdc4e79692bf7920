"""A real tiny SFT run with the Prometheus exporter on: what it serves is what metrics.jsonl says."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from posttrain.telemetry.gpu import GpuCollector, read_gpus
from tests.telemetry.conftest import run_and_scrape
from tests.train.conftest import base_overrides, read_jsonl

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC_NAME = re.compile(r"\bposttrain_[a-z0-9_]+")


@pytest.fixture(scope="module")
def scraped_run(tiny_model_dir, sft_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("exporter") / "run"
    started = time.time()
    scraped = run_and_scrape(base_overrides(tiny_model_dir, sft_data, out, **{
        "train.max_steps": 5, "train.save_every": 2, "debug.nan_steps": "[2]", "data.eval": sft_data}))
    assert scraped.returncode == 0, scraped.stderr[-3000:]
    assert scraped.text, "the run never lingered for its final scrape:\n" + scraped.stderr[-3000:]
    return scraped, read_jsonl(out / "metrics.jsonl"), started, time.time()


def test_the_scraped_gauges_are_the_last_logged_step(scraped_run):
    scraped, records, _, _ = scraped_run
    steps = [r for r in records if "loss" in r]
    last = steps[-1]
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4]
    expected = {"posttrain_train_loss": last["loss"], "posttrain_grad_norm": last["grad_norm"],
                "posttrain_learning_rate": last["lr"], "posttrain_tokens_per_second": last["tokens_per_s"],
                "posttrain_step_duration_seconds": last["step_time_s"], "posttrain_mfu_ratio": last["mfu"],
                "posttrain_data_wait_seconds": last["data_wait_s"],
                "posttrain_peak_memory_bytes": last["peak_memory_mb"] * 2**20}
    for name, value in expected.items():
        assert scraped.value(name) == pytest.approx(value, rel=1e-9), name
    evaluation = [r for r in records if "eval/loss" in r][-1]
    assert scraped.value("posttrain_eval_value", metric="loss") == pytest.approx(evaluation["eval/loss"], rel=1e-9)
    assert 0 < last["data_wait_s"] < last["step_time_s"]  # the wait is part of the step


def test_the_counters_count_steps_skips_checkpoints_and_alerts(scraped_run):
    scraped, records, started, ended = scraped_run
    assert scraped.value("posttrain_step") == scraped.value("posttrain_total_steps") == 5
    assert scraped.value("posttrain_steps_total") == 5
    # debug.nan_steps=[2]: one update skipped by the health guard, for a non-finite loss, and alerted.
    assert [r["step"] for r in records if r.get("skipped")] == [2]
    assert scraped.value("posttrain_skipped_updates_total") == 1
    assert scraped.value("posttrain_nonfinite_steps_total") == 1
    assert scraped.value("posttrain_alerts_total", kind="skipped_update") == 1
    assert scraped.value("posttrain_rollbacks_total") == 0
    # Checkpoints at steps 2 and 4 (save_every) and 5 (the end): the last one is 5.
    assert scraped.value("posttrain_checkpoints_total") == 3
    assert scraped.value("posttrain_checkpoint_last_step") == 5
    assert started < scraped.value("posttrain_checkpoint_last_commit_timestamp_seconds") < ended
    assert scraped.value("posttrain_checkpoint_save_duration_seconds") > 0
    # The save at step 2 (after step 1) is reported in the next step record, step 2's.
    saves = [r["step"] for r in records if "checkpoint_save_s" in r]
    assert saves == [2, 4] and all(r["checkpoint_save_s"] > 0 for r in records if "checkpoint_save_s" in r)
    heartbeat = scraped.value("posttrain_heartbeat_timestamp_seconds", rank="0")
    assert started < heartbeat < ended
    assert scraped.value("posttrain_world_size") == 1


def test_no_gpu_here_means_gpu_families_without_samples(scraped_run):
    """The truthful CPU path: NVML is absent (no driver), so the GPU names are served without values."""
    import torch

    scraped, _, _, _ = scraped_run
    families = scraped.families()
    readings = read_gpus()
    if torch.cuda.is_available():
        assert len(readings) >= 1 and all(0 <= r.utilization_ratio <= 1 and r.memory_total_bytes > 0 for r in readings)
    else:
        assert readings == []
        for name, _, _ in GpuCollector.FAMILIES:
            assert name in families and families[name].samples == [], name


def test_every_metric_the_dashboard_and_the_rules_read_is_exported(scraped_run):
    scraped, _, _, _ = scraped_run
    exported = set()
    for family in scraped.families().values():
        exported.add(family.name)
        exported.update(sample.name for sample in family.samples)
        if family.type == "counter":
            exported.add(family.name + "_total")  # a counter's sample name, also when it has no sample yet
    dashboard = json.loads((DEPLOY / "grafana" / "posttrain.json").read_text())
    used_in_dashboard = {name for panel in dashboard["panels"] for target in panel["targets"]
                         for name in METRIC_NAME.findall(target["expr"])}
    used_in_rules = set(METRIC_NAME.findall((DEPLOY / "prometheus" / "alerts.yaml").read_text()))
    assert len(used_in_dashboard) >= 15 and len(used_in_rules) >= 6
    assert used_in_dashboard - exported == set()
    assert used_in_rules - exported == set()
