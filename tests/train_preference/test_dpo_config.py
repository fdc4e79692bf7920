"""The dpo / rm config sections: defaults, and every bad combination refused with the fix in the message."""

from __future__ import annotations

import pytest

from posttrain.config import ConfigError, load_config
from posttrain.config.preference import DPORecipe, RewardModelRecipe

BASE = ["output_dir=/tmp/x", "model.path=/tmp/m", "data.train=/tmp/d.jsonl"]


def dpo(*overrides: str) -> DPORecipe:
    return load_config(DPORecipe, None, [*BASE, *overrides])


def refused(*overrides: str, schema=DPORecipe) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(schema, None, [*BASE, *overrides])
    return str(exc.value)


def test_defaults_pick_the_reference_mode_from_the_losses():
    assert dpo().dpo.reference_mode == "precomputed"
    assert dpo().dpo.losses == ["sigmoid"]
    assert dpo().data.truncation_side == "left"  # the prompt's oldest tokens go first
    simpo = dpo("dpo.loss=simpo", "dpo.simpo_gamma=0.3")
    assert simpo.dpo.reference_mode == "none"
    assert simpo.dpo.loss_params() == {"beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.3}
    mixed = dpo("dpo.loss=[sigmoid,orpo]", "dpo.loss_weights=[1.0,0.5]", "dpo.reference=live")
    assert mixed.dpo.losses == ["sigmoid", "orpo"] and mixed.dpo.reference_mode == "live"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["dpo.loss=sigmiod"], "did you mean 'sigmoid'"),
        (["dpo.reference=none"], "use dpo.reference=precomputed"),
        (["dpo.loss=simpo", "dpo.reference=precomputed"], "set dpo.reference=none"),
        (["dpo.simpo_gamma=0.5"], "it is read by simpo"),
        (["dpo.label_smoothing=0.1"], "it is used by cdpo (smoothing) and robust"),
        (["dpo.loss=[sigmoid,ipo]", "dpo.loss_weights=[1.0]"], "give one per loss"),
        (["dpo.loss=[sigmoid,sigmoid]"], "lists a loss twice"),
        (["dpo.loss=simpo", "dpo.reference_model=/tmp/r"], "no chosen loss uses a reference"),
        (["data.format=messages"], "is not preference data"),
        (["data.packing=true"], "set data.packing=false"),
        (["dpo.label_smoothing=0.5", "dpo.loss=cdpo"], "dpo.label_smoothing"),
        (["dpo.beta=0"], "dpo.beta"),
        (["dpo.betta=0.2"], "did you mean `dpo.beta`?"),
    ],
)
def test_bad_dpo_configs_are_refused_with_the_fix(overrides, expected):
    assert expected in refused(*overrides)


def test_data_train_is_required():
    with pytest.raises(ConfigError) as exc:
        load_config(DPORecipe, None, ["output_dir=/tmp/x", "model.path=/tmp/m"])
    assert "data" in str(exc.value)


def test_reward_model_needs_held_out_pairs():
    assert load_config(RewardModelRecipe, None, BASE).rm.holdout_fraction == 0.1
    message = refused("rm.holdout_fraction=0", schema=RewardModelRecipe)
    assert "set data.eval or rm.holdout_fraction > 0" in message
    assert load_config(RewardModelRecipe, None, [*BASE, "rm.holdout_fraction=0", "data.eval=/tmp/e.jsonl"])


def test_cli_lists_dpo_and_rm(capsys):
    from posttrain.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "dpo" in out and "rm" in out and "Bradley" in out
