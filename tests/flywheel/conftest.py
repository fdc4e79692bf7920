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


# What `overridden_run` passes on the command line: a dotted SFT override (issue 25 item 1) and a pair margin no
# score gap exceeds, so rejection sampling writes no pair (item 3: the round must still reach eval).
OVERRIDDEN = ["sft.overrides.train.max_steps=3", "sample.overrides.pair_margin=100"]


@pytest.fixture(scope="session")
def overridden_run(tmp_path_factory):
    """A reduced round run with ``OVERRIDDEN``: its exit code, run directory, recipe and printed output."""
    import contextlib
    import io

    run_dir = tmp_path_factory.mktemp("overridden") / "run"
    recipe = reduced_recipe(run_dir)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["flywheel", "--config", str(recipe), *OVERRIDDEN])
    return {"code": code, "run_dir": run_dir, "recipe": recipe, "out": out.getvalue(), "err": err.getvalue()}
