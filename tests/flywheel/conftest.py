"""The reduced flywheel round the tests here share (one per test process: it takes ~15 s on 2 cores).

Tests that change the run (a new DPO beta, the GRPO stage) re-run stages in place; tests that only read
it, or copy it first, may see it either before or after those changes.
"""

from __future__ import annotations

import pytest

from posttrain.cli import main
from tests.flywheel.reduced import reduced_recipe


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("quickstart") / "run"
    recipe = reduced_recipe(run_dir)
    assert main(["flywheel", "--config", str(recipe)]) == 0
    return run_dir, recipe
