"""Per-step metrics: progress with ETA, ``metrics.jsonl`` always, TensorBoard when installed, W&B / MLflow /
a Prometheus exporter when configured (``metrics.*``, docs/metrics.md), and the one-screen summary a run
ends with."""

from __future__ import annotations

import errno
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain import dist
from posttrain.config.sections import MetricsConfig
from posttrain.data.io import append_jsonl, parse_json_line, write_jsonl
from posttrain.telemetry.trackers import Tracker, open_trackers
from posttrain.train.checkpoint import DiskFullError
from posttrain.train.health import Alerts, finite_or_none

if TYPE_CHECKING:
    from posttrain.telemetry.prometheus import PrometheusExporter

# Dense bf16 peak FLOP/s per device, for MFU. Unknown devices fall back to train.peak_flops or the CPU guess.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}
CPU_PEAK_FLOPS_GUESS = 1e11  # a few AVX2 cores in fp32: an order-of-magnitude figure, set train.peak_flops for real numbers


def peak_flops(configured: float | None) -> float:
    if configured:
        return configured
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in PEAK_FLOPS.items():
            if key in name:
                return value
    return CPU_PEAK_FLOPS_GUESS


def train_flops_per_token(model: torch.nn.Module) -> float:
    """The model FLOPs one token costs a training step, input embeddings left out (a lookup, not a matmul).

    Per trainable weight value 6 (forward 2, input gradient 2, weight gradient 2: Kaplan et al. 2020's 6N);
    per frozen one 4, because its weight gradient is never computed: LoRA's and QLoRA's base, where 6N would
    overstate MFU by about 1.5x. No attention term, and recomputation is not counted (MFU, not HFU).
    A mixture of experts counts the experts a token is routed to: K/E of each stacked-experts weight
    (``posttrain.models.moe.active_share``; active, not total, parameters)."""
    from posttrain.models.lora import held_values
    from posttrain.models.moe import active_share

    embedding = model.get_input_embeddings().weight
    shares = active_share(model)
    trainable = frozen = 0.0
    for param in model.parameters():
        if param is embedding:
            continue
        values = held_values(param) * shares.get(id(param), 1.0)
        if param.requires_grad:
            trainable += values
        else:
            frozen += values
    return 6.0 * trainable + 4.0 * frozen


def mfu(flops_per_token: float, tokens_per_s: float, peak: float) -> float:
    """Model FLOP utilisation: ``flops_per_token`` (``train_flops_per_token``) × tokens/s ÷ peak FLOP/s."""
    return flops_per_token * tokens_per_s / peak


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


STEP_LOGS = ("metrics.jsonl", "units.jsonl")


def cut_logs(output_dir: Path, step: int) -> None:
    """On resume from the checkpoint at ``step``: drop what the lost steps ``>= step`` wrote to the per-step
    logs (and a torn last line), so they hold one record per step. Evaluations logged at ``step`` itself ran
    before that checkpoint was saved and stay; records without a step (before/after summaries) stay."""
    for name in STEP_LOGS:
        path = output_dir / name
        if not path.exists():
            continue
        kept = []
        for line in path.read_bytes().splitlines():
            record = parse_json_line(line)
            if not isinstance(record, dict):
                continue  # the line a kill cut short
            logged = record.get("step")
            if logged is None or logged < step or (logged == step and any(k.startswith("eval/") for k in record)):
                kept.append(record)
        write_jsonl(str(path), kept)


class MetricsSink:
    """Where the loop's records go: ``metrics.jsonl`` and the progress bar, then every tracker (TensorBoard,
    W&B, MLflow: ``posttrain.telemetry.trackers``) and the Prometheus exporter (``metrics.prometheus_port``;
    ``posttrain.telemetry.prometheus``), all from rank 0. One instance on every rank: ``step_finished`` is a
    collective when the exporter is on (each rank's heartbeat travels to rank 0)."""

    def __init__(self, output_dir: Path, total_steps: int, start_step: int, desc: str, tensorboard: bool = True,
                 telemetry: MetricsConfig | None = None, run_config: dict[str, Any] | None = None,
                 alerts: Alerts | None = None):
        telemetry = telemetry or MetricsConfig(tensorboard=tensorboard)
        self.enabled = dist.is_main()
        self.path = output_dir / "metrics.jsonl"
        self.trackers: list[Tracker] = []
        self.exporter: PrometheusExporter | None = None
        self.bar = None
        self.last_loss: float | None = None
        self.pending: dict[str, float] = {}  # fields for the next step record (the last checkpoint's save time)
        # Known on every rank (the config is), so every rank joins the latency probe or none does.
        self.probing = telemetry.prometheus_port is not None
        self.probe_every = telemetry.allreduce_probe_every
        self.finished_at = time.time()  # this rank's heartbeat: when its last step ended
        self.linger_s = telemetry.prometheus_linger_s
        if not self.enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.trackers = open_trackers(telemetry, output_dir, run_config or {}, tensorboard)
        if telemetry.prometheus_port is not None:
            from posttrain.telemetry.prometheus import PrometheusExporter

            self.exporter = PrometheusExporter(telemetry.prometheus_port, telemetry.prometheus_addr, total_steps,
                                               start_step, dist.world_size())
            print(f"[posttrain] metrics: Prometheus /metrics on {telemetry.prometheus_addr}:{self.exporter.port}",
                  file=sys.stderr, flush=True)
            if alerts is not None:
                alerts.listeners.append(self.exporter.alert)
        from posttrain.progress import progress

        # quiet_s=0: a training run's lines (loss, grad norm, skipped updates) are its record in the log, however short.
        self.bar = progress(total=total_steps, initial=start_step, desc=desc, unit="step", leave=True, quiet_s=0)

    def log(self, record: dict[str, Any], advance: bool = True, track: bool = True) -> None:
        """Append ``record`` to ``metrics.jsonl`` (every record: the run's own log, which the report draws and
        resume cuts); with ``track`` (every ``train.log_every``-th step, evaluations) also send it to the
        trackers and the exporter and show its figures in the progress line. ``advance``: a step ended."""
        if advance and self.pending:
            record, self.pending = {**record, **self.pending}, {}
        if "loss" in record:
            self.last_loss = record["loss"]
        if not self.enabled:
            return
        try:
            append_jsonl(str(self.path), [finite_or_none(record)])
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskFullError(errno.ENOSPC, f"no space left on the device writing {self.path}: free space "
                                    "and rerun to resume from the last checkpoint") from exc
            raise
        if track:
            for tracker in self.trackers:
                tracker.log(record)
            if self.exporter is not None:
                self.exporter.observe(record)
        if self.bar is not None and advance:
            if track:
                shown = {k: f"{record[k]:.4g}" for k in ("loss", "grad_norm", "lr") if k in record}
                if record.get("skipped"):
                    shown["update"] = "SKIPPED"  # a nan/inf or spiking loss is never shown as if it were applied
                self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)

    def step_finished(self, next_step: int, updates: Sequence[Any] = ()) -> None:
        """After every step, on every rank: the heartbeat time, the step counter, skipped and non-finite updates
        (``updates``: the step's ``UpdateResult``s) and, every ``metrics.allreduce_probe_every`` steps, a timed
        all-reduce (after a barrier, so it times the collective alone). The heartbeats themselves travel in the
        loop's per-step all-reduce (``heartbeats``)."""
        self.finished_at = time.time()
        if not self.probing:
            return
        latency = None
        if dist.initialized() and next_step % self.probe_every == 0:
            dist.barrier()
            probe = torch.ones(1024, dtype=torch.float32)
            started = time.perf_counter()
            dist.all_reduce_sum(probe)
            latency = time.perf_counter() - started
        if self.exporter is not None:
            self.exporter.step_finished(next_step, [(u.loss, u.grad_norm, u.ok) for u in updates])
            if latency is not None:
                self.exporter.allreduce.set(latency)

    def heartbeats(self, times: list[float]) -> None:
        """Every rank's last step end, as the loop's per-step all-reduce gathered them (rank 0 exports them)."""
        if self.exporter is not None:
            self.exporter.heartbeats(times)

    def checkpoint_committed(self, step: int, save_s: float, committed_at: float | None = None) -> None:
        """A checkpoint of ``step`` is committed (``save_s``: how long saving it took): exported, and
        ``checkpoint_save_s`` goes into the next step record."""
        self.pending["checkpoint_save_s"] = save_s
        if self.exporter is not None:
            self.exporter.checkpoint_committed(step, save_s, time.time() if committed_at is None else committed_at)

    def rewind(self, step: int) -> None:
        """The loop rolled back to the checkpoint of ``step``."""
        if self.exporter is not None:
            self.exporter.rolled_back(step)
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def skip(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self, finished: bool = False) -> None:
        """Close the trackers and the exporter; when the run ``finished``, the exporter first waits for one
        scrape of the final values (at most ``metrics.prometheus_linger_s``)."""
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self.exporter is not None:
            self.exporter.close(self.linger_s if finished else 0.0)
            self.exporter = None
        if self.bar is not None:
            self.bar.close()


@dataclass
class RunSummary:
    """What a finished run prints last: steps, losses, throughput, memory, where the export went."""

    steps: int = 0
    optimizer_steps: int = 0
    skipped_steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    final_loss: float | None = None
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    export: str | None = None

    def add_step(self, tokens: int, seconds: float, skipped: bool) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.skipped_steps += skipped

    def add_eval(self, step: int, figures: dict[str, float]) -> None:
        self.evals.append((step, dict(figures)))

    def lines(self, name: str) -> list[str]:
        out = [f"{name} finished: {self.steps} steps ({self.optimizer_steps} updates"
               + (f", {self.skipped_steps} skipped" if self.skipped_steps else "") + ")"]
        if self.final_loss is not None:
            out.append(f"  final train loss   {self.final_loss:.4f}")
        losses = [(step, figures["loss"]) for step, figures in self.evals if "loss" in figures]
        if losses:
            best_step, best = min(losses, key=lambda item: item[1])
            out.append(f"  eval loss          final {losses[-1][1]:.4f} (step {losses[-1][0]}), "
                       f"best {best:.4f} (step {best_step})")
        if self.seconds > 0:
            out.append(f"  throughput         {self.tokens / self.seconds:,.0f} tokens/s over the steps this process ran")
        out.append(f"  peak memory        {peak_memory_mb():,.0f} MB ({'GPU allocated' if torch.cuda.is_available() else 'RSS'})")
        if self.export:
            out.append(f"  export             {self.export}")
        return out
