"""The training loop every algorithm shares. Algorithms plug in a step source and a loss, not a subclass.

One optimizer step, top to bottom:
1. ask the source for the step's work (``source.next_step(step, model)``; see ``posttrain.train.source``):
   this rank's micro-batches and the step's *global* normaliser;
2. for each micro-batch: forward, loss ÷ the global normaliser (plus, for a mixture of experts, the weighted
   router losses ÷ the update's global token count: ``posttrain.train.router``), backward (metrics stay on
   the device);
   then, once per step, the source's ``before_update`` hook (the weights are still the step's starting ones);
3. clip the gradient norm, read loss, grad norm and metrics to the host in one copy (the update's only
   host sync: the health guard needs them), ask the guard, step the optimizer (or skip the update);
4. tell the source how the step went (``end_step``), log, evaluate and checkpoint when due (to local
   disk; with a remote run store the upload runs in the background, ``posttrain.store.uploader``); on a
   preemption signal, checkpoint and exit resumable — and also when the store stays down.

Nothing here assumes the data exists before its step, and the source's state is saved with every
checkpoint and restored on resume and on a health-guard rollback.
"""

from __future__ import annotations

import contextlib
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
from posttrain.store import RunStore
from posttrain.store.direct import DirectSaver
from posttrain.store.manifest import UNSIGNED
from posttrain.store.uploader import CheckpointUploader
from posttrain.train.checkpoint import (
    CheckpointInfo,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from posttrain.train.health import Alerts, HealthGuard
from posttrain.train.metrics import MetricsSink, RunSummary, cut_logs, mfu, peak_flops, peak_memory_mb
from posttrain.train.offload import ActivationOffload
from posttrain.train.precision import autocast
from posttrain.train.router import Routing
from posttrain.train.schedule import lr_multiplier
from posttrain.train.source import BatchSizeError, LossFn, StepBatch, StepSource
from posttrain.train.watchdog import Watchdog, hang_forever

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
    flops_per_token: float  # model FLOPs per token of a training step, for MFU (metrics.train_flops_per_token)
    peak_flops: float | None
    identity: dict[str, Any]  # the run's identity, recorded in every checkpoint (posttrain.train.identity)
    health: HealthGuard
    alerts: Alerts
    max_rollbacks: int = 5
    activation_offload: bool = False  # train.activation_offload: saved activations wait in host memory
    skip_steps: frozenset[int] = frozenset()
    eval_every: int | None = None
    evaluate: Evaluate | None = None  # held-out figures ({"loss": …}); logged as eval/<key>
    nan_steps: frozenset[int] = frozenset()
    spike_steps: frozenset[int] = frozenset()
    spike_factor: float = 1000.0
    crash_at_step: int | None = None
    hang_at_step: int | None = None  # the stall drill (debug.hang_at_step), already targeted by runner.loop_settings
    stall_timeout_s: float | None = None  # health.stall_timeout_s: the watchdog (posttrain.train.watchdog); None: off
    log_unit_ids: bool = False
    tensorboard: bool = True
    telemetry: MetricsConfig | None = None  # Prometheus, W&B, MLflow (posttrain.train.metrics.MetricsSink)
    run_config: dict[str, Any] | None = None  # the resolved config, logged as the trackers' run params
    resume_from: CheckpointInfo | None = None  # chosen by posttrain.train.identity.plan_resume
    store: RunStore | None = None  # a remote run store gets each checkpoint uploaded (posttrain.store)
    attempt: str = ""  # this start's id, the same on every rank
    upload: str = "background"  # store.upload: background | blocking
    routing: Routing | None = None  # an MoE policy's router hooks: router losses, balance, expert load (model.moe)
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
    offloaded_tensors: int = 0  # saved tensors this rank's forwards sent to host memory (train.activation_offload)
    router_stats: list[float] = field(default_factory=list)  # an MoE policy's routing over all ranks (Routing.take)


def _update(model, params, optimizer, loss_fn: LossFn, micro_batches: list[Any], normalizer: float, step: int,
            settings: LoopSettings, before_step: Callable[[], None] | None = None, tokens: float = 0.0) -> UpdateResult:
    """Forward/backward over one update's micro-batches, ``before_step`` (the source's, see ``StepBatch``),
    health check, optimizer step (or skip). ``tokens``: the update's tokens over all ranks, what an MoE
    policy's router losses are divided by."""
    world = dist.world_size()
    device = dist.device()
    loss_total = torch.zeros((), dtype=torch.float64, device=device)
    metric_totals: dict[str, torch.Tensor] = {}
    routing = settings.routing
    router_totals: torch.Tensor | None = None
    if routing is not None and routing.has_loss and tokens <= 0:
        raise ValueError("model.moe router losses are divided by the update's token count, and this step source "
                         "reports none (StepBatch.tokens)")
    capture = routing.capture if routing is not None else contextlib.nullcontext
    # Only around the forward: backward unpacks through the hooks recorded when each tensor was saved.
    offload = ActivationOffload() if settings.activation_offload else contextlib.nullcontext()
    for batch in micro_batches:
        with autocast(settings.precision, settings.sharded), offload, capture():
            loss_sum, metrics = loss_fn(model, batch)
        loss = loss_sum / normalizer
        if step in settings.nan_steps:
            loss = loss * float("nan")  # fault injection drill (debug.nan_steps)
        if step in settings.spike_steps:
            loss = loss * settings.spike_factor  # fault injection drill (debug.spike_steps)
        # Accumulated on the device and read once per update: no host sync per micro-batch.
        loss_total += loss.detach().to(torch.float64)
        if routing is not None:
            # The task loss alone is logged and guarded (comparable with a dense run's); the router losses
            # join it in the backward, and their unweighted values are logged as moe/… fields.
            router_loss, stats = routing.take(device)
            router_totals = stats if router_totals is None else router_totals + stats
            if router_loss is not None:
                loss = loss + router_loss / tokens
        # FSDP averages gradients over ranks; the loss is already a global mean, so undo the average.
        (loss * world).backward()
        for key, value in metrics.items():
            value = torch.as_tensor(value, dtype=torch.float64, device=device).detach()
            metric_totals[key] = metric_totals[key] + value if key in metric_totals else value
    if before_step is not None:
        before_step()
    grad_norm = _grad_norm(params, settings.max_grad_norm)
    routed = [router_totals] if router_totals is not None else []
    packed = dist.all_reduce_sum(torch.cat([torch.stack([loss_total, *metric_totals.values()]), *routed]))
    # The update's one host sync, whatever the number of micro-batches: the health guard decides on the
    # host whether to step, so it needs the loss and grad norm now; the metrics come along in the same copy.
    # (grad_norm is already global: clip_grad_norm_ reduces it over the ranks.)
    *values, grad_value = torch.cat([packed, grad_norm.detach().to(packed).reshape(1)]).tolist()
    values, router_stats = values[:1 + len(metric_totals)], values[1 + len(metric_totals):]
    loss_value = values[0]
    verdict = settings.health.check(loss_value, grad_value)
    if verdict.ok:
        optimizer.step()
        if routing is not None:
            routing.balance_step(router_stats)  # DeepSeek-V3's bias update, from this update's global load
    else:
        settings.alerts.emit("skipped_update", step=step, reason=verdict.reason, loss=loss_value, grad_norm=grad_value,
                             message=f"step {step}: update skipped by the health guard: {verdict.reason}")
    optimizer.zero_grad(set_to_none=True)
    return UpdateResult(loss_value, grad_value, dict(zip(metric_totals, values[1:], strict=True)), verdict.ok,
                        verdict.reason, verdict.rollback, getattr(offload, "offloaded", 0), router_stats)


class _Run:
    """The loop's own state and what it needs to save and restore it (model, optimizer, guard, source)."""

    def __init__(self, model, optimizer, source: StepSource, settings: LoopSettings, total_steps: int):
        self.model, self.optimizer, self.source, self.settings = model, optimizer, source, settings
        self.total_steps = total_steps
        self.root = settings.output_dir / "checkpoints"
        # store.signing_key and train.max_steps, which every checkpoint this loop writes or reads is checked by
        self.trust = settings.store.trust if settings.store is not None else UNSIGNED
        self.next_step, self.optimizer_steps, self.rollbacks = 0, 0, 0
        self.skip: set[int] = set(settings.skip_steps)
        self.last_saved = -1
        self.uploader, self.direct = _remote_checkpoints(settings)
        self.sink: MetricsSink | None = None
        if self.uploader is not None:
            self.uploader.on_commit = self._committed

    def trainer_state(self) -> dict[str, Any]:
        return {"next_step": self.next_step, "optimizer_steps": self.optimizer_steps, "rollbacks": self.rollbacks,
                "skip": sorted(self.skip), "health": self.settings.health.state(), "source": self.source.state(),
                "world_size": dist.world_size()}

    def restore(self, info) -> None:
        state = load_checkpoint(info, self.model, self.optimizer, max_step=self.total_steps)
        self.next_step, self.optimizer_steps = state["next_step"], state["optimizer_steps"]
        self.rollbacks, self.skip = state["rollbacks"], set(state["skip"]) | set(self.settings.skip_steps)
        self.settings.health.load(state["health"])
        self.source.load_state(state["source"])
        self.last_saved = self.next_step

    def save(self) -> None:
        """Checkpoint to local disk; with a remote store, then upload it (in the background unless
        ``store.upload=blocking``), after the previous upload has finished."""
        s = self.settings
        started = time.perf_counter()
        if self.direct is not None:  # store.upload=direct: DCP writes into the store itself
            if self.direct.save(self.next_step, self.model, self.optimizer, self.trainer_state(), s.identity):
                self._committed(self.next_step, time.perf_counter() - started)
            self.last_saved = self.next_step
            return
        if self.uploader is not None:
            self.uploader.wait()
            started = time.perf_counter()  # that wait was the previous checkpoint's upload
        saved = save_checkpoint(self.root, self.next_step, self.model, self.optimizer, self.trainer_state(),
                                s.identity, s.keep_last, per_node_dir=self.uploader is not None,
                                signing_key=self.trust.key)
        self.last_saved = self.next_step
        if self.uploader is None:
            self._committed(self.next_step, time.perf_counter() - started)
            return
        self.uploader.submit(saved.step, saved.path, saved.files, local_s=time.perf_counter() - started)
        if s.upload == "blocking":
            self.uploader.wait()

    def _committed(self, step: int, save_s: float, committed_at: float | None = None) -> None:
        """A checkpoint is committed (``save_s``: from the start of its save to the commit — with a remote store,
        the upload included: what a preemption's grace period must cover)."""
        if self.sink is not None:
            self.sink.checkpoint_committed(step, save_s, committed_at)

    def store_down(self) -> bool:
        return any(path is not None and path.down for path in (self.uploader, self.direct))

    def rollback_checkpoint(self) -> CheckpointInfo | None:
        """The newest valid checkpoint to roll back to. With a remote store it is the newest *committed* one
        (the upload in flight finishes first), fetched by the first process of each node — a node's own disk
        holds only its own shards, and with ``store.upload=direct`` nothing; files already there with the
        right sha256 are not downloaded again."""
        if self.uploader is not None:
            self.uploader.wait()
        if self.uploader is None and self.direct is None:
            return latest_valid_checkpoint(self.root, self.trust)
        store = self.settings.store
        fetched = dist.broadcast_object(store.fetch_latest() if dist.is_main() else None)
        if fetched is not None and dist.local_rank() == 0 and not dist.is_main():
            store.fetch_checkpoint(*fetched)
        dist.barrier()
        return CheckpointInfo.at(self.root, *fetched) if fetched is not None else None


def _remote_checkpoints(settings: LoopSettings) -> tuple[CheckpointUploader | None, DirectSaver | None]:
    """How checkpoints reach a remote store: uploaded from local disk, or written there by DCP (direct)."""
    store = settings.store
    if store is None or not store.remote:
        return None, None
    alert = settings.alerts.emit_own  # an upload's outcome is this rank's own news
    store.on_retry = lambda what, error: alert(
        "store_retry", what=what, error=str(error)[:300],
        message=f"run store {store.url}: {what} failed ({str(error)[:200]}); retrying with backoff for up to "
        f"store.max_outage_s={store.max_outage_s:g} s while training goes on")
    if settings.upload == "direct":
        return None, DirectSaver(store, settings.keep_last, alert)
    return CheckpointUploader(store, dist.rank(), dist.world_size(), settings.keep_last, settings.attempt, alert), None


def _stop_requests(preemption: Preemption, run: _Run, sink: MetricsSink) -> tuple[bool, bool]:
    """(preempted, store down) as every rank agrees, and every rank's heartbeat for the metrics: one small
    all-reduce per step carries all three."""
    flags = torch.zeros(2 + dist.world_size(), dtype=torch.float64)
    flags[0], flags[1] = float(preemption.requested), float(run.store_down())
    flags[2 + dist.rank()] = sink.finished_at
    dist.all_reduce_sum(flags)
    sink.heartbeats(flags[2:].tolist())
    return bool(flags[0] > 0), bool(flags[1] > 0)


def _stop_for_store(run: _Run, sink: MetricsSink) -> int:
    store = run.settings.store
    run.settings.alerts.emit("stopped_store_unavailable", step=run.next_step, store=store.url if store else None,
                             message=f"the run store {store.url if store else ''} stayed unavailable past "
                             f"store.max_outage_s; stopping at step {run.next_step} with exit 75 — rerun the same "
                             "command to resume from the newest checkpoint in the store")
    mark_preempted(None)
    sink.close()
    return EXIT_RESUMABLE


def _log_record(step: int, batch: StepBatch, updates: list[UpdateResult], lr: float, elapsed: float,
                settings: LoopSettings, normalizers: list[float]) -> dict[str, Any]:
    world = dist.world_size()
    metric_means: dict[str, float] = {}
    for update, norm in zip(updates, normalizers, strict=True):
        for key, value in update.metric_sums.items():
            metric_means[key] = metric_means.get(key, 0.0) + value / norm / len(updates)
    record = {
        "step": step,
        "time": time.time(),  # when the step ended (dashboards, and the checkpoint-cost benchmark)
        "loss": sum(u.loss for u in updates) / len(updates),
        "grad_norm": updates[-1].grad_norm,
        "lr": lr,
        "skipped": not all(u.ok for u in updates),
        "step_time_s": elapsed,
        "tokens_per_s": batch.tokens / elapsed,
        "loss_tokens_per_s": batch.loss_tokens / elapsed,
        "mfu": mfu(settings.flops_per_token, batch.tokens / elapsed / world, peak_flops(settings.peak_flops)),
        "peak_memory_mb": peak_memory_mb(),
        **metric_means,
        **batch.log,
    }
    if len(updates) > 1:
        record["updates"] = len(updates)
    if settings.activation_offload:
        record["offloaded_tensors"] = sum(u.offloaded_tensors for u in updates)
    if settings.routing is not None:
        record.update(settings.routing.log_fields([sum(s) for s in zip(*(u.router_stats for u in updates), strict=True)]))
    return record


def _warn_schedule(total_steps: int, settings: LoopSettings) -> None:
    if settings.warmup_steps >= total_steps:
        message = (f"train.warmup_steps={settings.warmup_steps} is as long as the whole run ({total_steps} steps): "
                   "the learning rate never reaches train.lr; lower warmup_steps")
        warnings.warn(message, stacklevel=3)
        settings.alerts.emit("config_warning", message=message)


def train(model: torch.nn.Module, source: StepSource, loss_fn: LossFn, settings: LoopSettings) -> int:
    """Run (or resume) training; return 0 when done or EXIT_RESUMABLE after a preemption save.

    The stall watchdog runs for the whole call; the loop beats it before every phase (step, evaluation,
    checkpoint save), and it ends the process with exit 75 when one takes longer than health.stall_timeout_s.
    """
    with Watchdog(settings.stall_timeout_s, settings.alerts) as watchdog:
        return _train(model, source, loss_fn, settings, watchdog)


def _train(model: torch.nn.Module, source: StepSource, loss_fn: LossFn, settings: LoopSettings,
           watchdog: Watchdog) -> int:
    total_steps = source.total_steps()
    if total_steps == 0:
        raise BatchSizeError(f"{source.name}: the data cannot fill one optimizer step; lower "
                             "train.global_batch_size, add data, or set train.max_steps (the data then repeats)")
    _warn_schedule(total_steps, settings)
    params = [p for p in model.parameters() if p.requires_grad]
    # The fused kernel does the whole AdamW update in one pass per tensor. The foreach path runs many
    # small ops instead: 12 ms vs 2.4 ms per step for 5M parameters on 2 idle CPU cores, and 0.5 s on
    # busy ones, where each small op waits for a core (benchmarks/sft_throughput.py).
    optimizer = torch.optim.AdamW(
        params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay, fused=True
    )
    run = _Run(model, optimizer, source, settings, total_steps)
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
            watchdog.beat("step", step)
            if step in run.skip:
                source.end_step(step, False, {})
                run.next_step += 1
                sink.skip()
                sink.step_finished(run.next_step)
            else:
                if settings.hang_at_step == step:
                    hang_forever()  # stall drill (debug.hang_at_step): before the step's collectives
                started = time.perf_counter()
                lr = settings.lr * lr_multiplier(step, total_steps, settings.lr_schedule, settings.warmup_steps,
                                                 settings.min_lr_ratio)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                waited = time.perf_counter()
                batch = source.next_step(step, model)
                data_wait = time.perf_counter() - waited
                groups = batch.groups()
                updates = [_update(model, params, optimizer, loss_fn, micro, norm, step, settings,
                                   batch.before_update if index == 0 else None, batch.tokens / len(groups))
                           for index, (micro, norm) in enumerate(groups)]
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
                # Every step goes to metrics.jsonl (its figures are host floats already: the health guard read
                # them); log_every thins what the trackers, the exporter and the progress line get.
                sink.log({**_log_record(step, batch, updates, lr, elapsed, settings, [n for _, n in groups]),
                          "data_wait_s": data_wait, **after_step},
                         track=step % settings.log_every == 0 or run.next_step == total_steps)
                if all(u.ok for u in updates):
                    bad_streak.clear()
                else:
                    bad_streak.append(step)
                if any(u.rollback for u in updates):
                    _roll_back(run, bad_streak, step, sink)
                    bad_streak.clear()
                    continue
                if settings.eval_every and run.next_step % settings.eval_every == 0 and run.next_step < total_steps:
                    watchdog.beat("evaluation", run.next_step)
                    _evaluate(model, settings, sink, run.next_step)
            due = settings.save_every and run.next_step % settings.save_every == 0
            if due and run.next_step < total_steps:
                watchdog.beat("checkpoint save", run.next_step)
                run.save()
            if settings.crash_at_step == step:
                os.kill(os.getpid(), signal.SIGKILL)  # node-loss drill (debug.crash_at_step)
            preempted, store_down = _stop_requests(preemption, run, sink)
            if store_down:
                return _stop_for_store(run, sink)
            if preempted:
                if run.last_saved != run.next_step:
                    watchdog.beat("checkpoint save", run.next_step)
                    run.save()
                if run.uploader is not None:
                    run.uploader.wait()  # the grace period is for this: the checkpoint must reach the store
                    if run.uploader.down:
                        return _stop_for_store(run, sink)
                settings.alerts.emit("preempted", step=run.next_step, signal=preemption.signal_name,
                                     message=f"preempted by {preemption.signal_name}: checkpoint at step {run.next_step} "
                                     "saved; rerun the same command to resume (exit 75)")
                mark_preempted(run.next_step)
                sink.close()
                return EXIT_RESUMABLE
    if run.last_saved != run.next_step:
        watchdog.beat("checkpoint save", run.next_step)
        run.save()
    if run.uploader is not None:
        watchdog.beat("checkpoint upload", run.next_step)
        run.uploader.wait()
        if run.uploader.down:
            return _stop_for_store(run, sink)
    watchdog.beat("evaluation", run.next_step)
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
    info = run.rollback_checkpoint()
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

