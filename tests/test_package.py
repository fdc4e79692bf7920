"""Every module imports; every YAML recipe validates (recursively); the CLI lists and documents its commands."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import posttrain
from posttrain.cli import main
from posttrain.config import resolve_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE_FILES = sorted(ROOT.glob("posttrain/recipes/**/*.yaml"))


def all_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(posttrain.__path__, prefix="posttrain."))


@pytest.mark.parametrize("name", all_modules())
def test_every_module_imports(name):
    module = importlib.import_module(name)
    assert module.__name__ == name and module.__doc__, f"{name} imports but has no module docstring"


def test_there_are_recipes():
    assert len(RECIPE_FILES) >= 1


@pytest.mark.parametrize("path", RECIPE_FILES, ids=[p.name for p in RECIPE_FILES])
def test_every_recipe_validates(path):
    name, config = resolve_recipe(path)
    assert config.model_dump()["recipe"] == name


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("validate", "data", "sft", "quickstart", "model", "dpo", "rm", "eval", "generate", "curate", "sample", "flywheel", "pretrain"):
        assert command in out
    assert "75" in out  # the documented resumable exit code


def test_validate_good_and_bad(tmp_path, capsys):
    good = ROOT / "posttrain" / "recipes" / "sft_tiny.yaml"
    assert main(["validate", "--config", str(good)]) == 0
    assert "valid `sft` recipe" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("  lr: 1.0e-3", "  learning_rat: 1.0e-3"))
    assert main(["validate", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "did you mean `train.lr`?" in err and f"{bad}:" in err


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "posttrain", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and posttrain.__version__ in proc.stdout
