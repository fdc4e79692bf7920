"""Exit codes that keep their promise: SIGTERM before the loop and to torchrun's agent end with 75; a full disk
is one line, leaves no half-written checkpoint, and a rerun on the same disk fails the same clean way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from posttrain.config.loader import load_config
from posttrain.config.recipes import SFTRecipe
from posttrain.config.registry import run_recipe
from tests.train.conftest import ROOT, base_overrides, env, read_jsonl, run_in_process


def test_sigterm_before_the_loop_ends_with_75_and_one_line(tiny_model_dir, sft_data, tmp_path, monkeypatch, capsys):
    import posttrain.train.sft as sft

    real = sft.tokenize_records

    def tokenize_then_get_preempted(*args, **kwargs):  # the scheduler's SIGTERM lands while data is prepared
        rows = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return rows

    monkeypatch.setattr(sft, "tokenize_records", tokenize_then_get_preempted)
    previous = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    config = load_config(SFTRecipe, None, [*base_overrides(tiny_model_dir, sft_data, out), "recipe=sft"])
    assert run_recipe("sft", config) == 75
    err = capsys.readouterr().err
    assert "preempted by SIGTERM outside the training loop" in err and "Traceback" not in err
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
    assert signal.getsignal(signal.SIGTERM) is previous  # the process's own handlers are back


@pytest.mark.slow
def test_sigterm_to_the_launcher_agent_ends_with_75(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 400, "train.batch_size": 2,
                                                                "train.global_batch_size": 4})
    command = [sys.executable, "-m", "posttrain", "launch", "--standalone", "--nproc_per_node", "2", "--", "sft",
               *overrides]
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 180
    while time.time() < deadline and len([m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # to the agent only, as a scheduler does
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err
    preempted = [a for a in read_jsonl(out / "alerts.jsonl") if a["kind"] == "preempted"]
    assert preempted and (out / "checkpoints" / f"step-{preempted[0]['step']:06d}" / "manifest.json").exists()
    assert "rerun the same command to resume" in err


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.decode().strip()}): needs root, as CI has")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(tiny_model_dir, sft_data, small_disk, capsys):
    out = small_disk / "run"  # a checkpoint of the tiny model is ~2.2 MB; the disk holds 1 MB
    overrides = base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 4, "train.save_every": 2})
    assert run_in_process(overrides) == 1
    err = capsys.readouterr().err
    assert "no space left on the device while writing checkpoint" in err and "Traceback" not in err
    assert not list((out / "checkpoints").glob("*.tmp")) and not list((out / "checkpoints").glob("step-*"))
    # A rerun on the same, still full disk: the same clean failure, not a crash writing alerts.jsonl.
    assert run_in_process(overrides) == 1
    err = capsys.readouterr().err
    assert "no space left on the device" in err and "Traceback" not in err
    alerts = out / "alerts.jsonl"
    assert all(json.loads(line) for line in (alerts.read_text().splitlines() if alerts.exists() else []))
