"""Per-step metrics: a progress bar with ETA, ``metrics.jsonl`` always, TensorBoard when installed."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from posttrain import dist

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


class MetricsSink:
    def __init__(self, output_dir: Path, total_steps: int, start_step: int, desc: str, tensorboard: bool = True):
        self.enabled = dist.is_main()
        self.path = output_dir / "metrics.jsonl"
        self.writer = None
        self.bar = None
        if not self.enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:
                self.writer = None  # optional extra: pip install 'posttrain[tensorboard]'
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)

    def log(self, record: dict[str, Any], advance: bool = True) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step":
                    self.writer.add_scalar(key, value, record["step"])
        if self.bar is not None and advance:
            shown = {k: record[k] for k in ("loss", "grad_norm", "lr") if k in record}
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
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
