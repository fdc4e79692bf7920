"""The packaged quickstart base: used exactly when a run would pretrain the same model, else pretrained here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from posttrain.config.loader import load_config
from posttrain.flywheel.config import FlywheelRecipe
from posttrain.flywheel.packaged_base import (
    METRICS,
    PACKAGED_DIR,
    PRETRAINED_ON,
    install_packaged_base,
    matching_packaged_base,
    write_packaged_base,
)
from posttrain.flywheel.run import stage_base, stage_data
from posttrain.flywheel.stages import StageRunner
from posttrain.report.collect import flywheel_round
from tests.flywheel.reduced import reduced_recipe

ROOT = Path(__file__).resolve().parents[2]


def _data(config: FlywheelRecipe, run_dir: Path) -> dict:
    (run_dir / "data").mkdir(parents=True)
    return stage_data(config, run_dir / "data")


def test_the_quickstart_installs_the_shipped_base(tmp_path):
    config = load_config(FlywheelRecipe, "quickstart", [f"run_dir={tmp_path}"])
    data = _data(config, tmp_path)
    assert matching_packaged_base(config, data) is not None, (
        "the quickstart's base inputs changed since the packaged base was made: run scripts/make_quickstart_base.py")
    outputs = StageRunner(tmp_path).run("base", {}, [], lambda out: stage_base(config, data, out))
    assert "packaged quickstart base" in outputs["packaged"]
    assert f"base model: {outputs['packaged']}" in flywheel_round(tmp_path)["notes"]  # the report says so
    final = Path(outputs["model"])
    assert final == tmp_path / "base" / "pretrain" / "final"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (final / name).read_bytes() == (PACKAGED_DIR / name).read_bytes()
    assert Path(outputs["metrics"]).read_bytes() == (PACKAGED_DIR / METRICS).read_bytes()
    assert (final / PRETRAINED_ON).read_text().strip() == data["corpus"]


def test_the_check_script_agrees():
    done = subprocess.run([sys.executable, "scripts/make_quickstart_base.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "matches the quickstart's inputs" in done.stdout


def test_a_packaged_base_is_used_only_for_the_inputs_it_was_made_from(tmp_path):
    config = load_config(FlywheelRecipe, reduced_recipe(tmp_path / "run"), [])
    data = _data(config, tmp_path / "run")
    (tmp_path / "run" / "base").mkdir()
    made = stage_base(config, data, tmp_path / "run" / "base")
    assert "packaged" not in made  # the shipped base was made from other inputs: pretrained here
    shipped = tmp_path / "shipped"
    provenance = write_packaged_base(config, data, made, {"command": "test", "date": "today"}, directory=shipped)
    assert not (shipped / PRETRAINED_ON).exists()
    assert provenance["loss"]["steps"] == 3

    assert matching_packaged_base(config, data, directory=shipped) == provenance
    for changes in (["base.packaged=false"], ["base.pretrain.overrides.train.lr=0.01"], ["base.hidden_size=48"],
                    ["base.model=/some/model"]):
        other = load_config(FlywheelRecipe, reduced_recipe(tmp_path / "run"), changes)
        assert matching_packaged_base(other, data, directory=shipped) is None, changes
    edited = tmp_path / "corpus.txt"
    edited.write_text(Path(data["corpus"]).read_text() + "one more document\n")
    assert matching_packaged_base(config, {**data, "corpus": str(edited)}, directory=shipped) is None

    installed = install_packaged_base(provenance, data["corpus"], tmp_path / "other" / "base", directory=shipped)
    for path in Path(made["model"]).iterdir():
        copy = Path(installed["model"]) / path.name
        assert copy.read_bytes() == path.read_bytes(), path.name  # PRETRAINED_ON too: the same corpus path
    assert Path(installed["metrics"]).read_bytes() == Path(made["metrics"]).read_bytes()
