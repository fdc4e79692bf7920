"""A flywheel stage's `overrides` merge key by key over the stage's recipe, dotted or nested alike; `posttrain
validate --stage` prints what the stage will run with; a key the stage's recipe lacks stops the run (exit 2)."""

from __future__ import annotations

import yaml

from posttrain.cli import main
from posttrain.recipes import find_recipe


def effective(capsys, *args: str) -> dict:
    """The config `posttrain validate --stage` prints (the YAML after its one header line)."""
    assert main(["validate", *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    return yaml.safe_load(out.split("\n", 1)[1])


def test_a_dotted_stage_override_keeps_every_other_value_of_the_recipe(capsys):
    recipe = yaml.safe_load(find_recipe("quickstart").read_text())["sft"]["overrides"]
    assert recipe["train.lr"] == 5e-3 and recipe["train.batch_size"] == 16 and recipe["train.max_length"] == 128
    sft = effective(capsys, "--config", "quickstart", "--stage", "sft", "sft.overrides.train.max_steps=200")
    assert sft["train"]["max_steps"] == 200
    assert (sft["train"]["lr"], sft["train"]["batch_size"], sft["train"]["max_length"]) == (5e-3, 16, 128)
    for key, value in recipe.items():  # every other override of the recipe, and sft_tiny's own keys under them
        if key != "train.max_steps":
            section, name = key.split(".")
            assert sft[section][name] == value, key
    assert sft["train"]["max_grad_norm"] == 1.0 and sft["health"]["max_consecutive"] == 3  # from sft_tiny.yaml
    assert sft["output_dir"] == "runs/quickstart/sft" and sft["data"]["train"] == "runs/quickstart/curate/kept.jsonl"


def test_nested_and_dotted_spellings_resolve_alike(capsys, tmp_path):
    quickstart = yaml.safe_load(find_recipe("quickstart").read_text())
    dotted = quickstart["sft"]["overrides"]
    nested: dict = {}
    for key, value in dotted.items():
        section, name = key.split(".")
        nested.setdefault(section, {})[name] = value
    nested["train"]["max_steps"] = 200
    path = tmp_path / "nested.yaml"
    path.write_text(yaml.safe_dump({**quickstart, "sft": {**quickstart["sft"], "overrides": nested}}, sort_keys=False))
    from_nested = effective(capsys, "--config", str(path), "--stage", "sft")
    from_dotted_cli = effective(capsys, "--config", "quickstart", "--stage", "sft", "sft.overrides.train.max_steps=200")
    from_flat_cli = effective(capsys, "--config", str(path), "--stage", "sft", "sft.overrides.train.lr=5e-3")
    assert from_nested == from_dotted_cli == from_flat_cli
    # next_round's overrides go through the same merge: nested there too, over the stage's own.
    path.write_text(yaml.safe_dump({**quickstart, "next_round": {"sft": {"train": {"lr": 1e-4}}}}, sort_keys=False))
    assert main(["validate", "--config", str(path), "--quiet"]) == 0


def test_a_misspelt_stage_key_is_exit_2_naming_the_nearest_key(capsys, tmp_path):
    assert main(["validate", "--config", "quickstart", "sft.overrides.train.max_stpes=200"]) == 2
    err = capsys.readouterr().err
    assert "`train.max_stpes`" in err and "did you mean `train.max_steps`?" in err
    # The same stops `posttrain flywheel` before any stage runs (nothing is written under run_dir).
    run_dir = tmp_path / "run"
    assert main(["flywheel", "--config", "quickstart", f"run_dir={run_dir}", "dpo.overrides.dpo.bta=0.2"]) == 2
    assert "did you mean `dpo.beta`?" in capsys.readouterr().err and not run_dir.exists()
    assert main(["validate", "--config", "quickstart", "next_round.sft.trian.lr=1e-3"]) == 2
    assert "did you mean `train.lr`?" in capsys.readouterr().err


def test_a_wrong_type_in_a_stage_override_is_exit_2_naming_the_stage(capsys):
    assert main(["validate", "--config", "quickstart", "sft.overrides.train.lr=fast"]) == 2
    err = capsys.readouterr().err
    assert "stage sft" in err and "`train.lr`" in err and "sft.overrides" in err


def test_validate_names_each_stage_and_refuses_an_unknown_one(capsys):
    assert main(["validate", "--config", "quickstart"]) == 0
    out = capsys.readouterr().out
    for stage in ("pretrain", "curate", "sft", "sample", "dpo", "next_round.sft"):
        assert f"stage {stage}:" in out
    assert "stage grpo:" not in out  # off in quickstart (its checks import torch); `--rl` turns it on
    assert main(["validate", "--config", "quickstart", "grpo.enabled=true"]) == 0
    assert "stage grpo:" in capsys.readouterr().out
    assert effective(capsys, "--config", "quickstart", "--stage", "grpo")["rl"]["group_size"] == 8
    assert main(["validate", "--config", "quickstart", "--stage", "dop"]) == 2
    assert "did you mean `dpo`?" in capsys.readouterr().err
    assert main(["validate", "--config", "sft_tiny", "--stage", "sft"]) == 2
    assert "flywheel" in capsys.readouterr().err


def test_the_flywheel_trains_sft_with_the_recipe_under_a_dotted_override(overridden_run):
    """The reduced round of ``overridden_run`` passed ``sft.overrides.train.max_steps=3`` on the command line."""
    run_dir = overridden_run["run_dir"]
    sft = yaml.safe_load((run_dir / "sft" / "config.yaml").read_text())
    assert sft["train"]["max_steps"] == 3
    # The rest of the stage's overrides (tests/flywheel/reduced.py over quickstart.yaml) still hold.
    assert (sft["train"]["lr"], sft["train"]["batch_size"], sft["train"]["max_length"]) == (5e-3, 4, 128)
    assert sft["data"]["curriculum"] == "competence" and sft["data"]["packing"] is True
