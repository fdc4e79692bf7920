"""Checkpoints, exact resume after SIGKILL, corrupt-checkpoint skip, SIGTERM, NaN/spike recovery, curriculum."""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from tests.train.conftest import (
    base_overrides,
    final_weights,
    read_jsonl,
    run_in_process,
    run_subprocess,
    sft_command,
    sigterm_after,
)


def weights_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


RESUME = {"train.max_steps": 8, "train.save_every": 2, "train.keep_last": 3}


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, sft_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **RESUME)) == 0
    return out


@pytest.mark.parametrize("crash_at", [4, 5])
def test_sigkill_resume_is_bit_exact(tiny_model_dir, sft_data, uninterrupted, tmp_path, crash_at):
    out = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, sft_data, out, **RESUME)
    crashed = run_subprocess([*overrides, f"debug.crash_at_step={crash_at}"])
    assert crashed.returncode == -signal.SIGKILL
    assert not (out / "final").exists()
    resumed = run_subprocess(overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    kinds = [a["kind"] for a in read_jsonl(out / "alerts.jsonl")]
    assert "resumed" in kinds
    assert weights_equal(final_weights(out), final_weights(uninterrupted))


@pytest.mark.slow
def test_sigkill_resume_two_ranks_bit_exact(tiny_model_dir, sft_data, tmp_path):
    common = {**RESUME, "train.batch_size": 2}
    clean = tmp_path / "clean"
    proc = run_subprocess(base_overrides(tiny_model_dir, sft_data, clean, **common), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "killed"
    overrides = base_overrides(tiny_model_dir, sft_data, out, **common)
    crashed = run_subprocess([*overrides, "debug.crash_at_step=5"], nproc=2)
    assert crashed.returncode != 0 and not (out / "final").exists()
    resumed = run_subprocess(overrides, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert weights_equal(final_weights(out), final_weights(clean))


def test_corrupt_checkpoint_is_skipped(tiny_model_dir, sft_data, uninterrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    shutil.rmtree(out / "final")
    ckpts = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step-000004", "step-000006", "step-000008"]
    newest = ckpts[-1]
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(b"garbage" + shard.read_bytes()[7:])  # same size, wrong bytes
    (ckpts[-2] / "manifest.json").unlink()  # an unfinished save
    with pytest.warns(UserWarning) as caught:
        assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **RESUME)) == 0
    messages = " ".join(str(w.message) for w in caught)
    assert "step-000008: checksum mismatch" in messages and "step-000006: manifest missing" in messages
    resumed = [a for a in read_jsonl(out / "alerts.jsonl") if a["kind"] == "resumed"][-1]
    assert resumed["step"] == 4
    assert weights_equal(final_weights(out), final_weights(uninterrupted))


def test_sigterm_saves_and_exits_resumable(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 400, "train.batch_size": 2})
    code, err = sigterm_after(sft_command(overrides), out, records=3)
    assert code == 75, err[-2000:]
    preempted = [a for a in read_jsonl(out / "alerts.jsonl") if a["kind"] == "preempted"]
    assert preempted and preempted[0]["signal"] == "SIGTERM"
    step = preempted[0]["step"]
    assert step < 400 and (out / "checkpoints" / f"step-{step:06d}" / "manifest.json").exists()
    assert not (out / "final").exists()


def test_nan_and_spike_are_skipped_and_recorded(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    extra = {"train.max_steps": 24, "train.lr": 1e-4,
             "debug.nan_steps": "[6]", "debug.spike_steps": "[10]"}
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **extra)) == 0
    alerts = read_jsonl(out / "alerts.jsonl")
    skipped = {a["step"]: a["reason"] for a in alerts if a["kind"] == "skipped_update"}
    assert "non-finite" in skipped[6] and "spike" in skipped[10]
    metrics = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m}
    assert metrics[6]["skipped"] and metrics[10]["skipped"] and not metrics[7]["skipped"]
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("step", [1, 2, 6])
def test_an_early_spike_is_caught_from_the_second_step(tiny_model_dir, sft_data, tmp_path, step):
    out = tmp_path / "run"
    extra = {"train.max_steps": 8, "debug.spike_steps": f"[{step}]"}
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **extra)) == 0
    skipped = [a["step"] for a in read_jsonl(out / "alerts.jsonl") if a["kind"] == "skipped_update"]
    assert skipped == [step]
    metrics = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m}
    assert [s for s, m in metrics.items() if m["skipped"]] == [step]


def test_alerts_are_strict_json_even_for_a_nan_loss(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **{"train.max_steps": 3,
                                                                          "debug.nan_steps": "[1]"})) == 0
    text = (out / "alerts.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    skipped = [json.loads(line, parse_constant=_refuse) for line in text.splitlines()]
    assert any(a["kind"] == "skipped_update" and a["loss"] is None for a in skipped)


def _refuse(name: str):
    raise ValueError(f"not strict JSON: {name}")


def test_streak_rolls_back_and_skips_bad_batches(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    extra = {"train.max_steps": 12, "train.save_every": 3, "health.max_consecutive": 2,
             "debug.nan_steps": "[7, 8]"}
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **extra)) == 0
    alerts = read_jsonl(out / "alerts.jsonl")
    rollbacks = [a for a in alerts if a["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 6 and rollbacks[0]["skipped_batches"] == [7, 8]
    steps = [m["step"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert steps.count(6) == 2  # replayed after the rollback
    assert steps[-1] == 11 and steps.count(7) == 1 and steps.count(8) == 1  # never retried
    assert (out / "final" / "model.safetensors").exists()


def test_tiered_curriculum_order_in_metrics(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    extra = {"data.curriculum": "tiered", "train.max_steps": "null", "train.epochs": 1, "train.batch_size": 4}
    assert run_in_process([*base_overrides(tiny_model_dir, sft_data, out), *[f"{k}={v}" for k, v in extra.items()]]) == 0
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    hardest = [max(int(k.split("_")[1]) for k in m if k.startswith("tier_")) for m in rows]
    easiest = [min(int(k.split("_")[1]) for k in m if k.startswith("tier_")) for m in rows]
    assert all(hardest[i] <= easiest[i + 1] for i in range(len(rows) - 1))
    assert easiest[0] == 1 and hardest[-1] == 3


def test_competence_curriculum_with_packing_fills_max_steps_easy_first(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    extra = {"data.curriculum": "competence", "data.packing": "true", "data.competence_start": 0.2,
             "train.max_length": 128, "train.batch_size": 2, "train.max_steps": 12, "data.competence_steps": 8}
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, out, **extra)) == 0
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in rows] == list(range(12))

    def mean_tier(row):
        counts = {int(k.split("_")[1]): v for k, v in row.items() if k.startswith("tier_")}
        return sum(t * n for t, n in counts.items()) / sum(counts.values())

    assert mean_tier(rows[0]) == 1.0  # c(0) = 0.2: only the easiest fifth (all tier 1) is drawn
    assert max(mean_tier(r) for r in rows[-4:]) > 1.5
