"""A health-guard rollback restores the step source's state too: BCO's running reward shift δ."""

from __future__ import annotations

import json

from tests.train.conftest import final_weights
from tests.train_preference.conftest import dpo_overrides, read_jsonl, run_cli

COMMON = {"dpo.loss": "bco_pair", "train.max_steps": 10, "train.save_every": 4, "train.keep_last": 3,
          "health.max_consecutive": 2}


def final_state(out) -> dict:
    return json.loads((out / "checkpoints" / "step-000010" / "trainer.json").read_text())


def test_a_rollback_run_ends_bit_identical_to_a_run_that_skipped_the_same_batches(pref_model_dir, pref_data, tmp_path):
    data = {"train": pref_data["train"]}
    rolled, skipped, plain = tmp_path / "rolled", tmp_path / "skipped", tmp_path / "plain"
    # Steps 6 and 7 spike; the second bad step in a row rolls back to the step-4 checkpoint, so steps 4
    # and 5 run twice — the second time from the restored model, optimizer, guard *and* δ.
    assert run_cli("dpo", dpo_overrides(pref_model_dir, data, rolled, **COMMON, **{"debug.spike_steps": "[6, 7]"})) == 0
    assert run_cli("dpo", dpo_overrides(pref_model_dir, data, skipped, **COMMON, **{"health.skip_steps": "[6, 7]"})) == 0
    assert run_cli("dpo", dpo_overrides(pref_model_dir, data, plain, **COMMON)) == 0

    rollbacks = [a for a in read_jsonl(rolled / "alerts.jsonl") if a["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 4 and rollbacks[0]["skipped_batches"] == [6, 7]
    steps = [m["step"] for m in read_jsonl(rolled / "metrics.jsonl") if "loss" in m]
    assert steps.count(4) == steps.count(5) == 2 and 8 in steps

    a, b = final_weights(rolled), final_weights(skipped)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    delta_rolled, delta_skipped = final_state(rolled)["source"], final_state(skipped)["source"]
    assert delta_rolled == delta_skipped  # bco_mean and bco_count, exactly
    assert delta_rolled["bco_count"] == (10 - 2) * 2 * 8  # the two skipped steps never entered δ
    # The skipped batches matter: training on them ends elsewhere (so the equality above is not vacuous).
    assert final_state(plain)["source"]["bco_mean"] != delta_skipped["bco_mean"]
