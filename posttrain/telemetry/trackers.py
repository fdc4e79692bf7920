"""Experiment trackers: the same per-step records as ``metrics.jsonl``, numbers only, from rank 0.

A tracker has ``log(record)`` (a record with its ``step``) and ``close()``; ``MetricsSink`` holds a list of
them and fans every record out once. TensorBoard (``metrics.tensorboard``, when installed), Weights &
Biases (``metrics.wandb``) and MLflow (``metrics.mlflow``) are the three; W&B and MLflow also get the
resolved config, secrets masked (``posttrain.config.redact``), as the run's config / params. A configured
tracker whose package is missing is an error that names the extra to install, raised on every rank before
training starts (``check_trackers``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class TrackerUnavailable(RuntimeError):
    """A configured tracker's package is not installed; the message says which extra to install."""


class Tracker(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields (bools as 0/1), without ``step``: what a tracker plots."""
    return {key: float(value) for key, value in record.items()
            if isinstance(value, int | float) and key != "step"}


def _import(module: str, setting: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TrackerUnavailable(f"{setting} is set but {module} is not installed: pip install "
                                 f"'posttrain[{extra}]' (or set {setting}=null)") from None


def check_trackers(metrics) -> None:
    """Fail early, on every rank, when a configured tracker cannot be imported (``metrics``: MetricsConfig)."""
    if metrics.wandb is not None and metrics.wandb.mode != "disabled":
        _import("wandb", "metrics.wandb", "wandb")
    if metrics.mlflow is not None:
        _import("mlflow", "metrics.mlflow", "mlflow")
    if metrics.prometheus_port is not None:
        _import("prometheus_client", "metrics.prometheus_port", "prometheus")


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"train.lr": "0.001", …}`` (MLflow params are flat strings)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_params(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat


class TensorBoardTracker:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # ImportError when tensorboard is absent

        self.writer = SummaryWriter(str(log_dir))

    def log(self, record: dict[str, Any]) -> None:
        for key, value in numbers(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run. Records are logged without W&B's own ``step=``: W&B drops a step lower than one it has
    seen, and a rollback or a resume repeats steps; the training step is the ``step`` field instead, and
    every chart is drawn against it (``define_metric``)."""

    def __init__(self, settings, output_dir: Path, params: dict[str, Any]):
        wandb = _import("wandb", "metrics.wandb", "wandb")
        self.run = wandb.init(project=settings.project, entity=settings.entity, mode=settings.mode,
                              dir=str(settings.dir or output_dir), config=params, name=output_dir.name,
                              reinit="create_new")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, record: dict[str, Any]) -> None:
        self.run.log({**numbers(record), "step": record["step"]})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """One MLflow run in ``experiment`` (created when missing); params are the flattened resolved config."""

    MAX_PARAM = 6000  # MLflow's limit on a param value's length

    def __init__(self, settings, params: dict[str, Any]):
        _import("mlflow", "metrics.mlflow", "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        self.client = MlflowClient(tracking_uri=settings.tracking_uri)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(settings.experiment))
        tags = {"mlflow.runName": settings.run_name} if settings.run_name else None
        self.run_id = self.client.create_run(experiment_id, tags=tags).info.run_id
        flat = [Param(key, value[: self.MAX_PARAM]) for key, value in flat_params(params).items()]
        for start in range(0, len(flat), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=flat[start:start + 100])

    def log(self, record: dict[str, Any]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self.Metric(key, value, now, record["step"]) for key, value in numbers(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(metrics, output_dir: Path, params: dict[str, Any], tensorboard: bool) -> list[Tracker]:
    """The trackers ``metrics`` (MetricsConfig) asks for, opened; rank 0 only."""
    trackers: list[Tracker] = []
    if tensorboard:
        try:
            trackers.append(TensorBoardTracker(output_dir / "tensorboard"))
        except ImportError:
            pass  # optional and on by default: pip install 'posttrain[tensorboard]'
    if metrics.wandb is not None and metrics.wandb.mode != "disabled":
        trackers.append(WandbTracker(metrics.wandb, output_dir, params))
    if metrics.mlflow is not None:
        trackers.append(MlflowTracker(metrics.mlflow, params))
    return trackers
