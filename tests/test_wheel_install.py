"""``pip install .`` (a real, non-editable install) works: from another directory, the installed package
answers ``--help``, validates and lists its packaged recipes by name, and runs a reduced quickstart round.

How the fresh environment is built, and why: a new venv (``python -m venv --without-pip``) whose
``site-packages`` holds one ``.pth`` file naming the test environment's ``site-packages``. The
dependencies (torch, transformers, pydantic…) are therefore importable without downloading or copying
gigabytes, so the test takes seconds; posttrain itself is installed into the fresh venv with
``pip install --no-deps --no-build-isolation --ignore-installed`` from a copy of the source tree (only
``pyproject.toml``, ``README.md`` and ``posttrain/``, so nothing outside the declared package can leak
in). The test environment's own posttrain is an editable install, hooked in by a ``.pth`` file of its
own; Python does not process ``.pth`` files inside a directory that another ``.pth`` file adds, so that
hook is inert here and ``import posttrain`` can only find the installed wheel, which the test checks.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.flywheel.reduced import reduced_recipe

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The fresh venv's bin directory, with posttrain installed from a wheel."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "posttrain", source / "posttrain", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    fresh_purelib = _run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         cwd=base).stdout.strip()
    (Path(fresh_purelib) / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = _run([str(bin_dir / "python"), "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                    "--ignore-installed", "--no-index", "--disable-pip-version-check", "-q", str(source)], cwd=base)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    return bin_dir


@pytest.fixture()
def elsewhere(tmp_path) -> Path:
    """A working directory with no repository in sight."""
    path = tmp_path / "elsewhere"
    path.mkdir()
    return path


def test_the_installed_copy_is_the_one_imported(installed, elsewhere):
    probe = ("import json, posttrain, posttrain.recipes as r; "
             "print(json.dumps([posttrain.__file__, str(r.RECIPES_DIR), sorted(r.packaged_recipes())]))")
    proc = _run([str(installed / "python"), "-c", probe], cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    module_file, recipes_dir, names = json.loads(proc.stdout)
    venv = str(installed.parent)
    assert module_file.startswith(venv) and recipes_dir.startswith(venv), (module_file, venv)
    assert {"quickstart", "sft_tiny", "dpo_tiny", "curate", "sample", "pretrain_tiny", "grpo_tools_tiny",
            "real/qwen3_0.6b_sft", "real/qwen3_0.6b_grpo_gsm8k", "real/llama3.2_1b_sft"} <= set(names)


def test_help_validate_and_recipes_from_another_directory(installed, elsewhere):
    posttrain = str(installed / "posttrain")
    version = _run([posttrain, "--version"], cwd=elsewhere)
    assert version.returncode == 0 and "posttrain 0." in version.stdout
    quick_help = _run([posttrain, "quickstart", "--help"], cwd=elsewhere)
    assert quick_help.returncode == 0 and "sft.overrides" in quick_help.stdout, quick_help.stderr[-2000:]
    for name in ("sft_tiny", "quickstart", "dpo_tiny"):
        valid = _run([posttrain, "validate", "--config", name], cwd=elsewhere)
        assert valid.returncode == 0 and "valid `" in valid.stdout, valid.stderr[-2000:]
    listing = _run([posttrain, "recipes", "list"], cwd=elsewhere)
    assert listing.returncode == 0 and "sft_tiny" in listing.stdout and "flywheel" in listing.stdout
    copied = _run([posttrain, "recipes", "copy", "sft_tiny"], cwd=elsewhere)
    assert copied.returncode == 0, copied.stderr
    assert (elsewhere / "sft_tiny.yaml").read_text() == (ROOT / "posttrain" / "recipes" / "sft_tiny.yaml").read_text()


@pytest.mark.slow
def test_reduced_quickstart_runs_from_the_wheel(installed, elsewhere):
    # The reduced round refers to its stage recipes by packaged name (quickstart.yaml's `recipe: sft_tiny`…),
    # so this also checks that stage references resolve inside the installed package.
    recipe = reduced_recipe(elsewhere / "run")
    proc = _run([str(installed / "posttrain"), "quickstart", "--config", str(recipe)], cwd=elsewhere, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((elsewhere / "run" / "report.json").read_text())
    assert set(report["scores"]) == {"base", "sft", "dpo"}
    assert (elsewhere / "run" / "report.html").is_file()


def test_the_wheel_carries_the_service_templates_the_calibration_set_and_the_packaged_base(installed, elsewhere):
    """Package data the code opens at run time: the feedback pages' templates, the curation calibration set and the
    quickstart's packaged base model."""
    script = ("import importlib.resources as r, posttrain; "
              "print(posttrain.__file__); "
              "print(sorted(p.name for p in r.files('posttrain.serve').joinpath('templates').iterdir())); "
              "print(sorted(p.name for p in r.files('posttrain.curate').joinpath('calibration').iterdir())); "
              "from posttrain.flywheel.packaged_base import PACKAGED_DIR; print(sorted(p.name for p in PACKAGED_DIR.iterdir()))")
    result = _run([str(installed / "python"), "-c", script], cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-2000:]
    where, templates, calibration, base = result.stdout.strip().splitlines()
    assert str(installed.parent) in where  # the wheel, not the source tree
    assert "annotate.html" in templates and "login.html" in templates
    assert any(name.endswith(".jsonl.gz") for name in ast.literal_eval(calibration))
    shipped = sorted(p.name for p in (ROOT / "posttrain" / "flywheel" / "packaged_base").iterdir())
    assert ast.literal_eval(base) == shipped and "model.safetensors" in shipped and "provenance.json" in shipped
