"""The training loop every algorithm shares. Algorithms plug in a step source and a loss, not a subclass.

One optimizer step, top to bottom:
1. ask the source for the step's work (``source.next_step(step, model)``; see ``posttrain.train.source``):
   this rank's micro-batches and the step's *global* normaliser;
2. for each micro-batch: forward, loss ÷ the global normaliser, backward (metrics stay on the device);
3. clip the gradient norm, ask the health guard, step the optimizer (or skip the update);
4. tell the source how the step went (``end_step``), log, evaluate and checkpoint when due; on a
   preemption signal, checkpoint and exit resumable.

Nothing here assumes the data exists before its step, and the source's state is saved with every
checkpoint and restored on resume and on a health-guard rollback.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain import dist
from posttrain.config.sections import MetricsConfig
from posttrain.data.io import append_jsonl
from posttrain.exit_codes import EXIT_RESUMABLE, mark_preempted
from posttrain.train.checkpoint import (
    CheckpointInfo,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from posttrain.train.health import Alerts, HealthGuard
from posttrain.train.metrics import MetricsSink, RunSummary, cut_logs, mfu, peak_flops, peak_memory_mb
from posttrain.train.precision import autocast
from posttrain.train.schedule import lr_multiplier
from posttrain.train.source import LossFn, StepBatch, StepSource

Evaluate = Callable[[torch.nn.Module], dict[str, float]]


@dataclass
class LoopSettings:
    output_dir: Path
    lr: float
    lr_schedule: str
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    betas: tuple[float, float]
    max_grad_norm: float | None
    save_every: int | None
    keep_last: int
    log_every: int
    precision: str
    sharded: bool
    params_for_mfu: int
    peak_flops: float | None
    identity: dict[str, Any]  # the run's identity, recorded in every checkpoint (posttrain.train.identity)
    health: HealthGuard
    alerts: Alerts
    max_rollbacks: int = 5
    skip_steps: frozenset[int] = frozenset()
    eval_every: int | None = None
    evaluate: Evaluate | None = None  # held-out figures ({"loss": …}); logged as eval/<key>
    nan_steps: frozenset[int] = frozenset()
    spike_steps: frozenset[int] = frozenset()
    spike_factor: float = 1000.0
    crash_at_step: int | None = None
    log_unit_ids: bool = False
    tensorboard: bool = True
    telemetry: MetricsConfig | None = None  # Prometheus, W&B, MLflow (posttrain.train.metrics.MetricsSink)
    run_config: dict[str, Any] | None = None  # the resolved config, logged as the trackers' run params
    resume_from: CheckpointInfo | None = None  # chosen by posttrain.train.identity.plan_resume
    summary: RunSummary = field(default_factory=RunSummary)


class Preemption:
    """Turns SIGTERM/SIGINT into a flag the loop checks between steps (all ranks agree via all-reduce)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0])
        return bool(dist.all_reduce_sum(flag).item() > 0)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _grad_norm(params: list[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"), foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@dataclass
class UpdateResult:
    loss: float
    grad_norm: float
    metric_sums: dict[str, float]  # over all ranks, un-normalised
    ok: bool
    reason: str
    rollback: bool


def _update(model, params, optimizer, loss_fn: LossFn, micro_batches: list[Any], normalizer: float, step: int,
            settings: LoopSettings) -> UpdateResult:
    """Forward/backward over one update's micro-batches, health check, optimizer step (or skip)."""
    world = dist.world_size()
    device = dist.device()
    loss_total = torch.zeros((), dtype=torch.float64, device=device)
    metric_totals: dict[str, torch.Tensor] = {}
    for batch in micro_batches:
        with autocast(settings.precision, settings.sharded):
            loss_sum, metrics = loss_fn(model, batch)
        loss = loss_sum / normalizer
        if step in settings.nan_steps:
            loss = loss * float("nan")  # fault injection drill (debug.nan_steps)
        if step in settings.spike_steps:
            loss = loss * settings.spike_factor  # fault injection drill (debug.spike_steps)
        # FSDP averages gradients over ranks; the loss is already a global mean, so undo the average.
        (loss * world).backward()
        # Accumulated on the device and read once per update: no host sync per micro-batch.
        loss_total += loss.detach().to(torch.float64)
        for key, value in metrics.items():
            value = torch.as_tensor(value, dtype=torch.float64, device=device).detach()
            metric_totals[key] = metric_totals[key] + value if key in metric_totals else value
    grad_norm = _grad_norm(params, settings.max_grad_norm)
    packed = dist.all_reduce_sum(torch.stack([loss_total, *metric_totals.values()]))
    values = packed.tolist()
    loss_value, grad_value = values[0], float(grad_norm)
    verdict = settings.health.check(loss_value, grad_value)
    if verdict.ok:
        optimizer.step()
    else:
        settings.alerts.emit("skipped_update", step=step, reason=verdict.reason, loss=loss_value, grad_norm=grad_value,
                             message=f"step {step}: update skipped by the health guard: {verdict.reason}")
    optimizer.zero_grad(set_to_none=True)
    return UpdateResult(loss_value, grad_value, dict(zip(metric_totals, values[1:], strict=True)), verdict.ok,
                        verdict.reason, verdict.rollback)


class _Run:
    """The loop's own state and what it needs to save and restore it (model, optimizer, guard, source)."""

    def __init__(self, model, optimizer, source: StepSource, settings: LoopSettings):
        self.model, self.optimizer, self.source, self.settings = model, optimizer, source, settings
        self.root = settings.output_dir / "checkpoints"
        self.next_step, self.optimizer_steps, self.rollbacks = 0, 0, 0
        self.skip: set[int] = set(settings.skip_steps)
        self.last_saved = -1
        self.sink: MetricsSink | None = None

    def trainer_state(self) -> dict[str, Any]:
        return {"next_step": self.next_step, "optimizer_steps": self.optimizer_steps, "rollbacks": self.rollbacks,
                "skip": sorted(self.skip), "health": self.settings.health.state(), "source": self.source.state(),
                "world_size": dist.world_size()}

    def restore(self, info) -> None:
        state = load_checkpoint(info, self.model, self.optimizer)
        self.next_step, self.optimizer_steps = state["next_step"], state["optimizer_steps"]
        self.rollbacks, self.skip = state["rollbacks"], set(state["skip"]) | set(self.settings.skip_steps)
        self.settings.health.load(state["health"])
        self.source.load_state(state["source"])
        self.last_saved = self.next_step

    def save(self) -> None:
        s = self.settings
        started = time.perf_counter()
        save_checkpoint(self.root, self.next_step, self.model, self.optimizer, self.trainer_state(), s.identity,
                        s.keep_last)
        self.last_saved = self.next_step
        if self.sink is not None:
            self.sink.checkpoint_committed(self.next_step, time.perf_counter() - started)


def _log_record(step: int, batch: StepBatch, updates: list[UpdateResult], lr: float, elapsed: float,
                settings: LoopSettings, normalizers: list[float]) -> dict[str, Any]:
    world = dist.world_size()
    metric_means: dict[str, float] = {}
    for update, norm in zip(updates, normalizers, strict=True):
        for key, value in update.metric_sums.items():
            metric_means[key] = metric_means.get(key, 0.0) + value / norm / len(updates)
    record = {
        "step": step,
        "loss": sum(u.loss for u in updates) / len(updates),
        "grad_norm": updates[-1].grad_norm,
        "lr": lr,
        "skipped": not all(u.ok for u in updates),
        "step_time_s": elapsed,
        "tokens_per_s": batch.tokens / elapsed,
        "loss_tokens_per_s": batch.loss_tokens / elapsed,
        "mfu": mfu(settings.params_for_mfu, batch.tokens / elapsed / world, peak_flops(settings.peak_flops)),
        "peak_memory_mb": peak_memory_mb(),
        **metric_means,
        **batch.log,
    }
    if len(updates) > 1:
        record["updates"] = len(updates)
    return record


def _warn_schedule(total_steps: int, settings: LoopSettings) -> None:
    if settings.warmup_steps >= total_steps:
        message = (f"train.warmup_steps={settings.warmup_steps} is as long as the whole run ({total_steps} steps): "
                   "the learning rate never reaches train.lr; lower warmup_steps")
        warnings.warn(message, stacklevel=3)
        settings.alerts.emit("config_warning", message=message)


def train(model: torch.nn.Module, source: StepSource, loss_fn: LossFn, settings: LoopSettings) -> int:
    """Run (or resume) training; return 0 when done or EXIT_RESUMABLE after a preemption save."""
    total_steps = source.total_steps()
    if total_steps == 0:
        raise ValueError(f"{source.name}: the data cannot fill one optimizer step; lower train.global_batch_size "
                         "or add data")
    _warn_schedule(total_steps, settings)
    params = [p for p in model.parameters() if p.requires_grad]
    # The fused kernel does the whole AdamW update in one pass per tensor. The foreach path runs many
    # small ops instead: 12 ms vs 2.4 ms per step for 5M parameters on 2 idle CPU cores, and 0.5 s on
    # busy ones, where each small op waits for a core (benchmarks/sft_throughput.py).
    optimizer = torch.optim.AdamW(
        params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay, fused=True
    )
    run = _Run(model, optimizer, source, settings)
    resumed = settings.resume_from
    if resumed is not None:
        run.restore(resumed)
        settings.alerts.emit("resumed", step=run.next_step, checkpoint=str(resumed.path), echo=False)
        if dist.is_main():  # one record per step: what the lost steps after the checkpoint wrote goes
            cut_logs(settings.output_dir, run.next_step)
    sink = MetricsSink(settings.output_dir, total_steps, run.next_step, source.name, settings.tensorboard,
                       settings.telemetry, settings.run_config, settings.alerts)
    run.sink = sink
    summary = settings.summary
    bad_streak: list[int] = []
    model.train()
    with Preemption() as preemption:
        while run.next_step < total_steps:
            step = run.next_step
            if step in run.skip:
                source.end_step(step, False, {})
                run.next_step += 1
                sink.skip()
                sink.step_finished(run.next_step)
            else:
                started = time.perf_counter()
                lr = settings.lr * lr_multiplier(step, total_steps, settings.lr_schedule, settings.warmup_steps,
                                                 settings.min_lr_ratio)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                waited = time.perf_counter()
                batch = source.next_step(step, model)
                data_wait = time.perf_counter() - waited
                groups = batch.groups()
                updates = [_update(model, params, optimizer, loss_fn, micro, norm, step, settings)
                           for micro, norm in groups]
                accepted = any(u.ok for u in updates)
                run.optimizer_steps += sum(u.ok for u in updates)
                totals: dict[str, float] = {}
                for update in updates:
                    for key, value in update.metric_sums.items():
                        totals[key] = totals.get(key, 0.0) + value
                after_step = source.end_step(step, accepted, totals) or {}
                run.next_step = step + 1
                if settings.log_unit_ids:
                    _log_units(settings.output_dir, step, batch.unit_ids)
                elapsed = time.perf_counter() - started
                summary.add_step(batch.tokens, elapsed, skipped=not accepted)
                sink.step_finished(run.next_step, updates)
                if step % settings.log_every == 0 or run.next_step == total_steps:
                    sink.log({**_log_record(step, batch, updates, lr, elapsed, settings, [n for _, n in groups]),
                              "data_wait_s": data_wait, **after_step})
                else:
                    sink.skip()
                if all(u.ok for u in updates):
                    bad_streak.clear()
                else:
                    bad_streak.append(step)
                if any(u.rollback for u in updates):
                    _roll_back(run, bad_streak, step, sink)
                    bad_streak.clear()
                    continue
                if settings.eval_every and run.next_step % settings.eval_every == 0 and run.next_step < total_steps:
                    _evaluate(model, settings, sink, run.next_step)
            due = settings.save_every and run.next_step % settings.save_every == 0
            if due and run.next_step < total_steps:
                run.save()
            if settings.crash_at_step == step:
                os.kill(os.getpid(), signal.SIGKILL)  # node-loss drill (debug.crash_at_step)
            if preemption.agreed():
                if run.last_saved != run.next_step:
                    run.save()
                settings.alerts.emit("preempted", step=run.next_step, signal=preemption.signal_name,
                                     message=f"preempted by {preemption.signal_name}: checkpoint at step {run.next_step} "
                                     "saved; rerun the same command to resume (exit 75)")
                mark_preempted(run.next_step)
                sink.close()
                return EXIT_RESUMABLE
    if run.last_saved != run.next_step:
        run.save()
    _evaluate(model, settings, sink, run.next_step)
    summary.steps, summary.optimizer_steps = run.next_step, run.optimizer_steps
    summary.final_loss = sink.last_loss
    sink.close(finished=True)
    return 0


def _roll_back(run: _Run, bad_streak: list[int], step: int, sink: MetricsSink) -> None:
    """Back to the newest valid checkpoint (model, optimizer, guard and source state), skipping the bad batches."""
    settings = run.settings
    if run.rollbacks >= settings.max_rollbacks:
        settings.alerts.emit("aborted", step=step, reason="too many rollbacks",
                             message=f"health guard: {run.rollbacks} rollbacks already; stopping at step {step}")
        raise RuntimeError(f"health guard: {run.rollbacks} rollbacks already; stopping at step {step}")
    skip = run.skip | set(bad_streak)
    rollbacks = run.rollbacks + 1
    info = latest_valid_checkpoint(run.root)
    if info is None:
        settings.alerts.emit("rollback_unavailable", step=step, skipped_batches=list(bad_streak),
                             message=f"health guard: {len(bad_streak)} bad steps in a row ({bad_streak}) and no "
                             "checkpoint to roll back to; skipping those batches from here on")
    else:
        run.restore(info)
        settings.alerts.emit("rollback", step=step, to_step=info.step, skipped_batches=list(bad_streak),
                             message=f"health guard: {len(bad_streak)} bad steps in a row ({bad_streak}): rolled back "
                             f"to the checkpoint at step {info.step}; those batches will be skipped")
        sink.rewind(run.next_step)
    run.skip, run.rollbacks = skip, rollbacks


def _evaluate(model: torch.nn.Module, settings: LoopSettings, sink: MetricsSink, step: int) -> None:
    if settings.evaluate is None:
        return
    figures = settings.evaluate(model)
    settings.summary.add_eval(step, figures)
    sink.log({"step": step, **{f"eval/{key}": value for key, value in figures.items()}}, advance=False)


def _log_units(output_dir: Path, step: int, unit_ids: list[str]) -> None:
    """``units.jsonl``: which units each rank trained on at each step (``debug.log_unit_ids``)."""
    gathered = dist.gather_objects(unit_ids)
    if dist.is_main():
        append_jsonl(str(output_dir / "units.jsonl"),
                     [{"step": step, "rank": rank, "ids": ids} for rank, ids in enumerate(gathered)])

