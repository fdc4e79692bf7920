"""The step reads the device once per optimizer update, however many micro-batches it accumulates."""

from __future__ import annotations

import pytest

from tests.train.conftest import base_overrides, read_jsonl, run_in_process
from tests.train.host_syncs import count_host_syncs
from tests.train_preference.conftest import dpo_overrides, preference_rows, run_cli, write_jsonl

STEPS = 2


def _syncs_and_losses(run, out) -> tuple[dict[str, int], list[float]]:
    with count_host_syncs() as counts:
        assert run(out) == 0
    return dict(counts), [m["loss"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]


def test_sft_syncs_per_step_do_not_grow_with_accumulation(tiny_model_dir, sft_data, tmp_path):
    def run(micro: int):
        return lambda out: run_in_process(base_overrides(
            tiny_model_dir, sft_data, out, **{"train.max_steps": STEPS, "train.global_batch_size": 4,
                                              "train.batch_size": micro, "data.shuffle": "false"}))

    one, loss_one = _syncs_and_losses(run(4), tmp_path / "accum1")
    four, loss_four = _syncs_and_losses(run(1), tmp_path / "accum4")
    # One copy per update (loss, metrics and grad norm together), for the health guard.
    assert one == four == {"tolist": STEPS}
    assert loss_one == pytest.approx(loss_four, rel=1e-5)


def test_dpo_syncs_per_step_do_not_grow_with_accumulation(tiny_model_dir, tmp_path):
    data = {"train": str(write_jsonl(tmp_path / "pairs.jsonl", preference_rows(16, seed=1)))}

    def run(micro: int):
        return lambda out: run_cli("dpo", dpo_overrides(
            tiny_model_dir, data, out, **{"train.max_steps": STEPS, "train.global_batch_size": 4,
                                          "train.batch_size": micro, "data.shuffle": "false"}))

    one, _ = _syncs_and_losses(run(4), tmp_path / "accum1")
    four, _ = _syncs_and_losses(run(1), tmp_path / "accum4")
    assert one == four == {"tolist": STEPS}
    # The seven preference metrics still reach the log, summed on the device and read with the loss.
    logged = [m for m in read_jsonl(tmp_path / "accum4" / "metrics.jsonl") if "loss" in m]
    assert {"rewards/accuracy", "rewards/margin", "logps/chosen", "kl_to_ref"} <= logged[0].keys()
