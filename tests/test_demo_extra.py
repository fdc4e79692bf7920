"""``make demo`` installs only the ``demo`` extra: a quickstart round must run with nothing else importable.

How the lean environment is built, and why: installing ``.[demo]`` into a fresh venv takes minutes, so
the test builds one from the packages already installed here. It reads ``pyproject.toml`` (the core
``dependencies`` and the ``demo`` extra), follows each requirement through the installed packages'
metadata (``Requires-Dist``, markers evaluated, extras followed) to the closure ``pip install
'.[demo]'`` would install, and links only those distributions' top-level files into a new venv's
``site-packages``; posttrain itself comes from this checkout through a ``.pth`` file. Everything else
installed here (peft, bitsandbytes, fastapi, datasets…) is then absent, as after ``make demo``, which
the test checks before it runs a reduced quickstart round (tests/flywheel/reduced.py) end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.flywheel.reduced import reduced_recipe

ROOT = Path(__file__).resolve().parents[1]


def demo_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["demo"]]


def closure(requirements: list[str]) -> set[str]:
    """Canonical names of the distributions ``requirements`` pull in, through the installed metadata."""
    wanted: dict[str, set[str]] = {}  # name → the extras asked of it
    todo = [Requirement(text) for text in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in wanted and requirement.extras <= wanted[name]:
            continue  # seen, with these extras
        asked = wanted[name] = wanted.get(name, set()) | requirement.extras
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{name} (needed by the demo extra) is not installed in the test environment")
        for text in requires:
            dependency = Requirement(text)
            environments = [{"extra": extra} for extra in ("", *sorted(asked))]
            if dependency.marker is None or any(dependency.marker.evaluate(env) for env in environments):
                todo.append(dependency)
    return set(wanted)


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", POSTTRAIN_PROGRESS="lines")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def lean_python(tmp_path_factory) -> Path:
    """The python of a venv holding exactly what ``pip install '.[demo]'`` installs."""
    base = tmp_path_factory.mktemp("demo")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], base).stdout.strip())
    here = Path(sysconfig.get_paths()["purelib"])
    allowed = closure(demo_requirements())
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in allowed:
            continue
        # Top-level entries only (a package directory, a module, a .libs folder, the .dist-info); __pycache__
        # is shared by single-module distributions, and a .pyc there without its source imports nothing.
        for top in {Path(str(file)).parts[0] for file in dist.files or ()} - {"..", "__pycache__"}:
            if (here / top).exists() and not (site / top).exists():
                (site / top).symlink_to(here / top)
    checkout = base / "checkout"
    checkout.mkdir()
    (checkout / "posttrain").symlink_to(ROOT / "posttrain")
    (site / "posttrain_checkout.pth").write_text(f"{checkout}\n")
    return python


def test_the_lean_environment_holds_the_demo_extra_and_nothing_more(lean_python, tmp_path):
    probe = ("import importlib.util as u; "
             "print(' '.join(m for m in ('plotly', 'torch', 'transformers', 'posttrain', 'peft', 'bitsandbytes', "
             "'fastapi', 'datasets', 'pytest') if u.find_spec(m)))")
    proc = _run([str(lean_python), "-c", probe], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["plotly", "torch", "transformers", "posttrain"]


def test_a_quickstart_round_runs_on_the_demo_extra_alone(lean_python, tmp_path):
    run_dir = tmp_path / "run"
    proc = _run([str(lean_python), "-m", "posttrain", "quickstart", "--config", str(reduced_recipe(run_dir))], tmp_path,
                timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (run_dir / "report.html").stat().st_size > 10_000 and (run_dir / "report.json").is_file()


def test_more_rounds_name_the_extras_they_need_before_any_work(lean_python, tmp_path):
    run_dir = tmp_path / "run"
    proc = _run([str(lean_python), "-m", "posttrain", "quickstart", "--config", str(reduced_recipe(run_dir)),
                 "--rounds", "2"], tmp_path)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "needs the embeddings, serve extras" in line and "pip install 'posttrain[embeddings,serve]'" in line
    assert not run_dir.exists()  # refused before the first stage
