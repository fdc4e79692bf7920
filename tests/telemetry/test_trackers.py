"""W&B (offline) and MLflow (a local file store) get the same step records as metrics.jsonl, read back."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from posttrain.config.redact import REDACTED
from posttrain.telemetry.trackers import TrackerUnavailable, check_trackers, flat_params
from tests.train.conftest import base_overrides, read_jsonl, run_in_process

LOGGED = ("loss", "grad_norm", "lr", "data_wait_s")


def wandb_records(path: Path):
    """The records of a ``.wandb`` run file: W&B's header, then LevelDB-log framing (32 KiB blocks; each
    chunk a 7-byte header — crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) around protobuf
    ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0:
            continue
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


WEBHOOK = "http://127.0.0.1:9/hooks/T000/s3cr3tT0ken"  # a credential: trackers must never see it


@pytest.fixture(scope="module")
def tracked_run(tiny_model_dir, sft_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    out = root / "run"
    overrides = base_overrides(tiny_model_dir, sft_data, out, **{
        "train.max_steps": 3, "metrics.wandb": "{project: posttrain-test, mode: offline, dir: " + str(root) + "}",
        "metrics.mlflow": "{tracking_uri: file://" + str(root / "mlruns") + ", experiment: tiny, run_name: sft}",
        "alerts.webhook": WEBHOOK})
    monkey = pytest.MonkeyPatch()
    monkey.setenv("WANDB_SILENT", "true")
    monkey.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this opt-in
    try:
        assert run_in_process(overrides) == 0
    finally:
        monkey.undo()
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    return root, steps


def test_wandb_offline_run_holds_every_step_record_and_the_config(tracked_run):
    root, steps = tracked_run
    (run_file,) = (root / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, exited = [], {}, False
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        exited |= kind == "exit"
    assert exited  # the run was finished, not left open
    assert [row["step"] for row in history] == [0, 1, 2]
    for row, step in zip(history, steps, strict=True):
        for key in LOGGED:
            assert row[key] == pytest.approx(step[key], rel=1e-12), key
        assert row["skipped"] == 0  # a bool, logged as a number
    assert config["train"]["max_steps"] == 3 and config["metrics"]["wandb"]["mode"] == "offline"
    assert config["alerts"]["webhook"] == REDACTED and b"s3cr3tT0ken" not in run_file.read_bytes()


def test_mlflow_file_store_holds_every_step_record_and_the_config_as_params(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    root, steps = tracked_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file://{root / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.run_name == "sft" and run.info.status == "FINISHED"
    for key in LOGGED:
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [0, 1, 2]
        assert [m.value for m in history] == pytest.approx([s[key] for s in steps], rel=1e-12), key
    assert run.data.params["train.max_steps"] == "3" and run.data.params["metrics.mlflow.experiment"] == "tiny"
    assert run.data.params["alerts.webhook"] == REDACTED
    assert not any("s3cr3tT0ken" in value for value in run.data.params.values())


def test_log_every_thins_the_trackers_but_not_metrics_jsonl(tiny_model_dir, sft_data, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{
        "train.max_steps": 6, "train.log_every": 2,
        "metrics.mlflow": "{tracking_uri: file://" + str(tmp_path / "mlruns") + ", experiment: thin}"})) == 0
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] == [0, 1, 2, 3, 4, 5]
    client = MlflowClient(tracking_uri=f"file://{tmp_path / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("thin").experiment_id])
    # Every log_every-th step, and the last one (so a dashboard shows where the run ended).
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 2, 4, 5]


def test_a_configured_tracker_that_is_not_installed_names_the_extra(monkeypatch):
    from posttrain.config.sections import MetricsConfig

    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does for a package that is not installed
    with pytest.raises(TrackerUnavailable, match=r"pip install 'posttrain\[wandb\]'"):
        check_trackers(MetricsConfig(wandb={"project": "p"}))
    check_trackers(MetricsConfig(wandb={"project": "p", "mode": "disabled"}))  # disabled needs nothing


def test_flat_params_flattens_nested_sections_to_strings():
    assert flat_params({"train": {"lr": 0.001, "betas": [0.9, 0.95]}, "output_dir": "out", "x": None}) == {
        "train.lr": "0.001", "train.betas": "[0.9, 0.95]", "output_dir": "out", "x": "null"}
