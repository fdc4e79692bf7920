"""GRPO test inputs: built-in reasoning prompts and the overrides of a tiny, fast GRPO run."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def rl_data(tmp_path_factory) -> str:
    from posttrain.data.io import write_records
    from posttrain.tasks.emit import rl_prompts

    path = tmp_path_factory.mktemp("rldata") / "prompts.jsonl"
    write_records(str(path), rl_prompts(64, 3, groups=["reasoning"]))
    return str(path)


def grpo_overrides(model: str, data: str, out: Path, **extra) -> list[str]:
    """A run small enough for CI: 4 prompts × G=4 per step, 8 new tokens, a dense python reward."""
    settings = {
        "model.path": model, "data.train": data, "output_dir": str(out),
        "train.global_batch_size": 4, "train.batch_size": 8, "train.max_length": 96, "train.max_steps": 4,
        "train.lr": 1e-3, "train.seed": 0, "metrics.tensorboard": "false",
        "rl.group_size": 4, "rl.max_new_tokens": 8, "rl.rollout_batch_size": 16,
        "reward.terms": '[{"kind": "python", "function": "tests.rl.grpo_rewards:letter_share"}]',
        "reward.workers": 0,
    }
    settings.update(extra)
    return [f"{k}={v}" for k, v in settings.items()]


def killed_and_resumed(run: Callable[[list[str]], subprocess.CompletedProcess], overrides: list[str], out: Path,
                       crash_at: int, check: Callable[[Path], None] | None = None) -> subprocess.CompletedProcess:
    """The node-loss drill as a test: ``run(overrides)`` SIGKILLed at step ``crash_at`` (``debug.crash_at_step``),
    ``check(out)`` on what it left, then the same command again, which must resume from the last checkpoint and
    finish. ``out`` is the run's output_dir; the resumed run's process is returned."""
    from tests.train.conftest import read_jsonl

    crashed = run([*overrides, f"debug.crash_at_step={crash_at}"])
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    assert not (out / "final").exists()
    if check is not None:
        check(out)
    resumed = run(overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in [a["kind"] for a in read_jsonl(out / "alerts.jsonl")]
    return resumed
