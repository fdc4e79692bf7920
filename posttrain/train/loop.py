"""The training loop every algorithm shares. Algorithms plug in an ``Objective``, not a subclass.

One optimizer step, top to bottom:
1. take the step's global batch of units (the stream fixes which; see ``posttrain.train.stream``);
2. for each micro-batch of this rank: forward, loss ÷ the step's *global* normaliser, backward;
3. clip the gradient norm, ask the health guard, step the optimizer (or skip the update);
4. log metrics; checkpoint when due; on a preemption signal, checkpoint and exit resumable.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain import dist
from posttrain.train.checkpoint import latest_valid_checkpoint, load_checkpoint, save_checkpoint
from posttrain.train.health import Alerts, HealthGuard
from posttrain.train.metrics import MetricsSink, mfu, peak_flops, peak_memory_mb
from posttrain.train.schedule import lr_multiplier
from posttrain.train.stream import step_slice

EXIT_RESUMABLE = 75


@dataclass
class Objective:
    """What an algorithm contributes to the loop.

    - ``units``: the run's ordered training units (examples, packed rows, pairs…).
    - ``collate(units) -> batch``: tensors for one micro-batch.
    - ``normalizer(units) -> float``: a step's loss is divided by the sum of this over the global batch
      (loss tokens for SFT, pairs for DPO), so accumulation and rank count do not change the gradient.
    - ``loss(model, batch) -> (loss_sum, metric_sums)``: the *un-normalised* loss sum of the micro-batch
      and metric sums (divided by the same normaliser for logging).
    - ``describe(units) -> dict``: extra per-step log fields (e.g. tiers drawn).
    - ``token_counts(units) -> (tokens, loss_tokens)``: for throughput and MFU.
    """

    name: str
    units: Sequence[Any]
    collate: Callable[[list[Any]], dict[str, torch.Tensor]]
    normalizer: Callable[[list[Any]], float]
    loss: Callable[[torch.nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    describe: Callable[[list[Any]], dict[str, Any]] = lambda units: {}
    token_counts: Callable[[list[Any]], tuple[int, int]] = lambda units: (0, 0)
    eval_units: Sequence[Any] = ()


@dataclass
class LoopSettings:
    output_dir: Path
    batch_size: int
    grad_accum: int
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
    autocast_bf16: bool
    params_for_mfu: int
    peak_flops: float | None
    config_hash: str
    health: HealthGuard
    alerts: Alerts
    max_rollbacks: int = 5
    nan_steps: frozenset[int] = frozenset()
    spike_steps: frozenset[int] = frozenset()
    spike_factor: float = 1000.0
    crash_at_step: int | None = None
    tensorboard: bool = True
    extra_state: dict[str, Any] = field(default_factory=dict)


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


def _autocast(enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)


def _grad_norm(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def evaluate(model: torch.nn.Module, objective: Objective, batch_size: int, autocast_bf16: bool) -> float | None:
    """Mean loss over ``objective.eval_units`` (sharded over ranks, reduced globally)."""
    units = list(objective.eval_units)
    if not units:
        return None
    world, rank = dist.world_size(), dist.rank()
    total = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        # Every rank runs the same number of forwards (FSDP gathers are collectives).
        rounds = math.ceil(len(units) / (batch_size * world))
        for index in range(rounds):
            start = (index * world + rank) * batch_size
            chunk = units[start : start + batch_size] or units[:1]
            weight = 1.0 if units[start : start + batch_size] else 0.0
            with _autocast(autocast_bf16):
                loss_sum, _ = objective.loss(model, objective.collate(chunk))
            total += torch.tensor([float(loss_sum) * weight, objective.normalizer(chunk) * weight], dtype=torch.float64)
    model.train()
    dist.all_reduce_sum(total)
    return float(total[0] / max(total[1], 1.0))


def train(model: torch.nn.Module, objective: Objective, settings: LoopSettings) -> int:
    """Run (or resume) training; return 0 when done or EXIT_RESUMABLE after a preemption save."""
    world, rank = dist.world_size(), dist.rank()
    per_step = settings.batch_size * settings.grad_accum * world
    total_steps = len(objective.units) // per_step
    if total_steps == 0:
        raise ValueError(
            f"{len(objective.units)} training units cannot fill one step of {per_step} "
            "(batch_size × grad_accum × ranks); lower train.batch_size or add data"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    # The fused kernel does the whole AdamW update in one pass per tensor. The foreach path runs many
    # small ops instead: 12 ms vs 2.4 ms per step for 5M parameters on 2 idle CPU cores, and 0.5 s on
    # busy ones, where each small op waits for a core (benchmarks/sft_throughput.py).
    optimizer = torch.optim.AdamW(
        params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay, fused=True
    )
    ckpt_root = settings.output_dir / "checkpoints"
    state: dict[str, Any] = {"next_batch": 0, "optimizer_steps": 0, "skip": [], "rollbacks": 0}
    resumed = latest_valid_checkpoint(ckpt_root, settings.config_hash)
    if resumed is not None:
        state = load_checkpoint(resumed, model, optimizer)
        settings.health.load(state["health"])
        settings.alerts.emit("resumed", step=state["next_batch"], checkpoint=str(resumed.path))

    def trainer_state() -> dict[str, Any]:
        return {**state, "health": settings.health.state(), **settings.extra_state}

    def checkpoint_now() -> None:
        save_checkpoint(
            ckpt_root, state["next_batch"], model, optimizer, trainer_state(), settings.config_hash, settings.keep_last
        )

    sink = MetricsSink(settings.output_dir, total_steps, state["next_batch"], objective.name, settings.tensorboard)
    peak = peak_flops(settings.peak_flops)
    bad_streak: list[int] = []
    last_saved = state["next_batch"] if resumed is not None else -1
    model.train()
    with Preemption() as preemption:
        while state["next_batch"] < total_steps:
            batch_index = state["next_batch"]
            if batch_index in set(state["skip"]):
                state["next_batch"] += 1
                sink.skip()
                continue
            started = time.perf_counter()
            lr = settings.lr * lr_multiplier(
                batch_index, total_steps, settings.lr_schedule, settings.warmup_steps, settings.min_lr_ratio
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            global_units = list(objective.units[batch_index * per_step : (batch_index + 1) * per_step])
            norm = max(float(objective.normalizer(global_units)), 1.0)
            sums = torch.zeros(1, dtype=torch.float64)
            metric_sums: dict[str, float] = {}
            for micro in range(settings.grad_accum):
                units = list(objective.units[step_slice(batch_index, micro, rank, settings.batch_size, settings.grad_accum, world)])
                with _autocast(settings.autocast_bf16):
                    loss_sum, metrics = objective.loss(model, objective.collate(units))
                loss = loss_sum / norm
                if batch_index in settings.nan_steps:
                    loss = loss * float("nan")  # fault injection drill (debug.nan_steps)
                if batch_index in settings.spike_steps:
                    loss = loss * settings.spike_factor  # fault injection drill (debug.spike_steps)
                # FSDP averages gradients over ranks; the loss is already a global mean, so undo the average.
                (loss * world).backward()
                sums += float(loss.detach())
                for key, value in metrics.items():
                    metric_sums[key] = metric_sums.get(key, 0.0) + float(value) / norm
            grad_norm = _grad_norm(params, settings.max_grad_norm)
            packed = torch.tensor([float(sums), *metric_sums.values()], dtype=torch.float64)
            dist.all_reduce_sum(packed)
            step_loss = float(packed[0])
            verdict = settings.health.check(step_loss, grad_norm)
            if verdict.ok:
                optimizer.step()
                state["optimizer_steps"] += 1
                bad_streak.clear()
            else:
                bad_streak.append(batch_index)
                settings.alerts.emit("skipped_update", step=batch_index, reason=verdict.reason, loss=step_loss, grad_norm=grad_norm)
            optimizer.zero_grad(set_to_none=True)
            state["next_batch"] = batch_index + 1

            elapsed = time.perf_counter() - started
            if batch_index % settings.log_every == 0 or state["next_batch"] == total_steps:
                tokens, loss_tokens = objective.token_counts(global_units)
                record = {
                    "step": batch_index,
                    "loss": step_loss,
                    "grad_norm": grad_norm,
                    "lr": lr,
                    "skipped": not verdict.ok,
                    "step_time_s": elapsed,
                    "tokens_per_s": tokens / elapsed,
                    "loss_tokens_per_s": loss_tokens / elapsed,
                    "mfu": mfu(settings.params_for_mfu, tokens / elapsed / world, peak),
                    "peak_memory_mb": peak_memory_mb(),
                    **{key: float(value) for key, value in zip(metric_sums, packed[1:].tolist(), strict=True)},
                    **objective.describe(global_units),
                }
                sink.log(record)
            else:
                sink.skip()

            if verdict.rollback:
                if state["rollbacks"] >= settings.max_rollbacks:
                    settings.alerts.emit("aborted", step=batch_index, reason="too many rollbacks")
                    raise RuntimeError(f"health guard: {state['rollbacks']} rollbacks already; stopping at step {batch_index}")
                info = latest_valid_checkpoint(ckpt_root)
                skip = sorted(set(state["skip"]) | set(bad_streak))
                rollbacks = state["rollbacks"] + 1
                if info is None:
                    settings.alerts.emit("rollback_unavailable", step=batch_index, skipped_batches=bad_streak)
                    state["skip"], state["rollbacks"] = skip, rollbacks
                else:
                    state = load_checkpoint(info, model, optimizer)
                    settings.health.load(state["health"])
                    state["skip"], state["rollbacks"] = skip, rollbacks
                    settings.alerts.emit("rollback", step=batch_index, to_step=info.step, skipped_batches=bad_streak)
                    sink.rewind(state["next_batch"])
                bad_streak.clear()
                continue

            due = settings.save_every and state["next_batch"] % settings.save_every == 0
            if due and state["next_batch"] < total_steps:
                checkpoint_now()
                last_saved = state["next_batch"]
            if settings.crash_at_step == batch_index:
                os.kill(os.getpid(), signal.SIGKILL)  # node-loss drill (debug.crash_at_step)
            if preemption.agreed():
                if last_saved != state["next_batch"]:
                    checkpoint_now()
                settings.alerts.emit("preempted", step=state["next_batch"], signal=preemption.signal_name)
                sink.close()
                return EXIT_RESUMABLE
    if last_saved != state["next_batch"]:
        checkpoint_now()
    eval_loss = evaluate(model, objective, settings.batch_size, settings.autocast_bf16)
    if eval_loss is not None:
        sink.log({"step": state["next_batch"], "eval_loss": eval_loss}, advance=False)
    sink.close()
    return 0
