"""Per-step metrics: progress with ETA, ``metrics.jsonl`` always, TensorBoard when installed, and the
one-screen summary a run ends with."""

from __future__ import annotations

import errno
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain import dist
from posttrain.data.io import append_jsonl, parse_json_line, write_jsonl
from posttrain.train.checkpoint import DiskFullError
from posttrain.train.health import finite_or_none

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


def mfu(params: int, tokens_per_s: float, peak: float) -> float:
    """Model FLOP utilisation: 6·N·tokens/s ÷ peak (Kaplan et al. 2020's 6N FLOPs per token, no attention term)."""
    return 6.0 * params * tokens_per_s / peak


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
    def __init__(self, output_dir: Path, total_steps: int, start_step: int, desc: str, tensorboard: bool = True):
        self.enabled = dist.is_main()
        self.path = output_dir / "metrics.jsonl"
        self.writer = None
        self.bar = None
        self.last_loss: float | None = None
        if not self.enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:
                self.writer = None  # optional extra: pip install 'posttrain[tensorboard]'
        from posttrain.progress import progress

        self.bar = progress(total=total_steps, initial=start_step, desc=desc, unit="step", leave=True)

    def log(self, record: dict[str, Any], advance: bool = True) -> None:
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
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self.writer.add_scalar(key, value, record["step"])
        if self.bar is not None and advance:
            shown = {k: f"{record[k]:.4g}" for k in ("loss", "grad_norm", "lr") if k in record}
            if record.get("skipped"):
                shown["update"] = "SKIPPED"  # a nan/inf or spiking loss is never shown as if it were applied
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)

    def rewind(self, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def skip(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
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
