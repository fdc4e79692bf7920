"""A run checkpointed on 2 ranks resumes on 1 and back on 2: same data position, same loss curve."""

from __future__ import annotations

import pytest

from tests.train.conftest import base_overrides, read_jsonl, run_subprocess

COMMON = {"train.max_steps": 8, "train.save_every": 2, "train.keep_last": 4, "train.global_batch_size": 8,
          "train.max_grad_norm": "null", "debug.log_unit_ids": "true"}


def last_execution(out) -> tuple[dict[int, list[str]], dict[int, float]]:
    """Per step, the units of every rank and the loss of the step's *last* execution (a killed run repeats
    the steps after its last checkpoint)."""
    units: dict[int, list[str]] = {}
    seen_ranks: dict[int, set[int]] = {}
    for row in read_jsonl(out / "units.jsonl"):
        step, rank = row["step"], row["rank"]
        if rank in seen_ranks.setdefault(step, set()):  # a repeat of the step starts its list afresh
            seen_ranks[step], units[step] = set(), []
        seen_ranks[step].add(rank)
        units.setdefault(step, []).extend(row["ids"])
    losses = {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m}
    return units, losses


@pytest.mark.slow
def test_two_ranks_to_one_and_back_keep_the_data_position_and_the_loss_curve(tiny_model_dir, sft_data, tmp_path):
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    assert run_subprocess(base_overrides(tiny_model_dir, sft_data, whole, **COMMON, **{"train.batch_size": 8})).returncode == 0
    overrides = base_overrides(tiny_model_dir, sft_data, moved, **COMMON, **{"train.batch_size": 4})
    first = run_subprocess([*overrides, "debug.crash_at_step=2"], nproc=2)  # killed after step 2; checkpoint at 2
    assert first.returncode != 0 and not (moved / "final").exists()
    second = run_subprocess([*overrides, "debug.crash_at_step=5"])  # 1 rank: resumes at 2, checkpoints 4 and 6
    assert second.returncode < 0, second.stderr[-3000:]
    assert "resharding it for 1" in second.stderr
    third = run_subprocess(overrides, nproc=2)  # back on 2 ranks from step 6
    assert third.returncode == 0, third.stderr[-3000:]
    resumed = [a["step"] for a in read_jsonl(moved / "alerts.jsonl") if a["kind"] == "resumed"]
    assert resumed == [2, 6]

    units_whole, loss_whole = last_execution(whole)
    units_moved, loss_moved = last_execution(moved)
    assert sorted(units_moved) == sorted(units_whole) == list(range(8))
    for step in range(8):
        # Every step trained on exactly the uninterrupted run's units: none seen twice, none skipped.
        assert sorted(units_moved[step]) == sorted(units_whole[step]), step
        assert loss_moved[step] == pytest.approx(loss_whole[step], rel=1e-4), step
