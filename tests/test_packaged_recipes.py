"""Recipes ship in the package: found by name anywhere, listed and copied by ``posttrain recipes``, and
flywheel stages refer to other packaged recipes by name."""

from __future__ import annotations

import pytest
import yaml

from posttrain.cli import main
from posttrain.config import load_config, resolve_recipe
from posttrain.config.recipes import SFTRecipe
from posttrain.flywheel.config import FlywheelRecipe
from posttrain.recipes import RECIPES_DIR, find_recipe, packaged_recipes


def test_every_recipe_is_inside_the_package():
    names = packaged_recipes()
    assert {"quickstart", "sft_tiny", "dpo_tiny", "rm_tiny", "curate", "sample", "pretrain_tiny", "sft_lora_tiny",
            "dpo_lora_tiny"} <= set(names)
    assert all(path.is_relative_to(RECIPES_DIR) and path.is_file() for path in names.values())  # real/: a subfolder


@pytest.mark.parametrize("spelling", ["sft_tiny", "sft_tiny.yaml", "recipes/sft_tiny.yaml"])
def test_a_name_finds_the_packaged_file_from_any_directory(spelling, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_recipe(spelling) == RECIPES_DIR / "sft_tiny.yaml"
    assert load_config(SFTRecipe, spelling).recipe == "sft"


def test_an_existing_file_wins_over_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "sft_tiny.yaml"
    local.write_text((RECIPES_DIR / "sft_tiny.yaml").read_text().replace("output_dir: runs/sft-tiny", "output_dir: mine"))
    assert find_recipe("sft_tiny.yaml").resolve() == local.resolve()
    assert resolve_recipe("sft_tiny.yaml")[1].output_dir == "mine"
    assert resolve_recipe("sft_tiny")[1].output_dir != "mine"  # no file called `sft_tiny`: the packaged one


def test_an_unknown_name_says_what_exists(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="did you mean `sft_tiny`"):
        find_recipe("sft_tiy")
    assert main(["validate", "--config", "sft_tiy"]) == 2
    assert "packaged recipes:" in capsys.readouterr().err


def test_validate_and_errors_name_the_packaged_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "--config", "dpo_tiny", "--quiet"]) == 0
    assert main(["validate", "--config", "sft_tiny", "train.learning_rat=1"]) == 2
    assert "did you mean `train.lr`?" in capsys.readouterr().err


def test_flywheel_stage_references_resolve_to_recipes_of_the_right_kind():
    flywheels = [path for path in packaged_recipes().values() if yaml.safe_load(path.read_text())["recipe"] == "flywheel"]
    assert flywheels
    for path in flywheels:
        config = load_config(FlywheelRecipe, path)
        stages = {"pretrain": config.base.pretrain, "curate": config.curate, "sft": config.sft,
                  "sample": config.sample, "dpo": config.dpo}
        for kind, stage in stages.items():
            assert stage.recipe in packaged_recipes(), f"{path.name}: {stage.recipe} is not a packaged recipe name"
            assert yaml.safe_load(find_recipe(stage.recipe).read_text())["recipe"] == kind


def test_recipes_list_shows_every_recipe_with_its_kind(capsys):
    assert main(["recipes", "list"]) == 0
    out = capsys.readouterr().out
    for name, path in packaged_recipes().items():
        kind = yaml.safe_load(path.read_text())["recipe"]
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert line.split()[1] == kind, line


def test_recipes_copy_writes_the_file_and_refuses_to_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    original = (RECIPES_DIR / "dpo_tiny.yaml").read_text()
    assert main(["recipes", "copy", "dpo_tiny"]) == 0
    assert (tmp_path / "dpo_tiny.yaml").read_text() == original
    (tmp_path / "dpo_tiny.yaml").write_text("edited")
    assert main(["recipes", "copy", "dpo_tiny"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "dpo_tiny.yaml").read_text() == "edited"
    assert main(["recipes", "copy", "dpo_tiny", "--force"]) == 0
    assert (tmp_path / "dpo_tiny.yaml").read_text() == original
    (tmp_path / "mine").mkdir()
    assert main(["recipes", "copy", "sft_tiny", "mine"]) == 0
    assert (tmp_path / "mine" / "sft_tiny.yaml").is_file()
    assert main(["recipes", "copy", "sft_tiny", "other.yaml"]) == 0
    assert resolve_recipe(tmp_path / "other.yaml")[0] == "sft"
    assert main(["recipes", "copy", "nope"]) == 2
