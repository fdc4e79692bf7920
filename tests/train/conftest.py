"""Helpers for training tests: a tiny SFT dataset with tiers, and ways to run the recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def make_sft_jsonl(path: Path, n: int = 48, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    lines = []
    for i in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        tier = 1 + i % 3
        if tier == 1:
            prompt, answer = f"What is {a} plus {b}?", f"{a + b}"
        elif tier == 2:
            prompt, answer = f"Which is larger, {a} or {b}?", f"{max(a, b)}"
        else:
            prompt, answer = f"Reverse the word {'cat dog fox owl'.split()[i % 4]}.", "tac god xof lwo".split()[i % 4]
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        if i % 5 == 0:  # some multi-turn chats
            messages += [{"role": "user", "content": "Are you sure?"}, {"role": "assistant", "content": "Yes."}]
        lines.append(json.dumps({"messages": messages, "tier": tier}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory) -> str:
    return str(make_sft_jsonl(tmp_path_factory.mktemp("sftdata") / "train.jsonl"))


def base_overrides(model: str, data: str, out: Path, **extra) -> list[str]:
    settings = {
        "model.path": model,
        "data.train": data,
        "output_dir": str(out),
        "train.batch_size": 4,
        "train.max_length": 64,
        "train.max_steps": 6,
        "train.lr": 1e-3,
        "train.lr_schedule": "cosine",
        "train.warmup_steps": 1,
        "train.seed": 0,
        "metrics.tensorboard": "false",
    }
    settings.update(extra)
    return [f"{k}={v}" for k, v in settings.items()]


def run_in_process(overrides: list[str]) -> int:
    from posttrain.cli import main

    return main(["sft", *overrides])


def env() -> dict[str, str]:
    result = dict(os.environ)
    result.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"})
    return result


def sft_command(overrides: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "posttrain", "sft", *overrides]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "posttrain", "sft", *overrides,
    ]


def run_subprocess(overrides: list[str], nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        sft_command(overrides, nproc), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout
    )


def final_weights(out: Path) -> dict:
    return load_file(str(out / "final" / "model.safetensors"))


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sigterm_after(command: list[str], out: Path, records: int) -> tuple[int, str]:
    """Start ``command``, send it SIGTERM once ``out/metrics.jsonl`` holds ``records`` records (the loop is
    running), and return its exit code and stderr — the scheduler's preemption notice, as a test."""
    import signal
    import time

    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_jsonl(out / "metrics.jsonl")) < records:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err

