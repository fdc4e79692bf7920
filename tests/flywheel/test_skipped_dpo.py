"""A DPO stage with fewer pairs than ``dpo.min_pairs`` (none at all, or a handful) is skipped with its reason: the
round still evaluates what it trained, and the report says "DPO skipped: N pairs" instead of comparing a model
that never trained."""

from __future__ import annotations

import json

from posttrain.cli import main
from tests.flywheel.conftest import OVERRIDDEN


def test_zero_pairs_skip_dpo_and_the_round_goes_on_to_eval(overridden_run):
    run = overridden_run
    run_dir = run["run_dir"]
    assert run["code"] == 0, run["err"][-3000:]
    skipped = json.loads((run_dir / "dpo" / "stage.json").read_text())["outputs"]
    assert skipped["pairs"] == 0 and skipped["skipped"].startswith("DPO skipped: 0 pairs")
    assert not (run_dir / "dpo" / "final").exists() and not (run_dir / "eval_dpo").exists()
    assert (run_dir / "eval_sft" / "results.json").exists()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["models"] == ["base", "sft"] and set(report["comparisons"]) == {"base->sft"}
    assert report["skipped"] == {"dpo": skipped["skipped"]}
    assert any(line.startswith("DPO skipped: 0 pairs") for line in report["summary"])
    assert "DPO skipped: 0 pairs" in run["out"]  # the summary printed at the end of the run
    assert "DPO skipped: 0 pairs" in (run_dir / "report.html").read_text()


def test_a_handful_of_pairs_below_min_pairs_skip_dpo_with_the_knob_named(overridden_run, capsys):
    run_dir, recipe = overridden_run["run_dir"], overridden_run["recipe"]
    # Pairs again (any score gap makes one), but fewer than the minimum asked for.
    again = [o for o in OVERRIDDEN if not o.startswith("sample.")] + ["dpo.overrides.dpo.min_pairs=1000"]
    assert main(["flywheel", "--config", str(recipe), *again]) == 0
    out = capsys.readouterr().out
    outputs = json.loads((run_dir / "dpo" / "stage.json").read_text())["outputs"]
    pairs = sum(1 for line in (run_dir / "sample" / "preferences.jsonl").read_text().splitlines() if line.strip())
    assert 0 < pairs < 1000 and outputs["pairs"] == pairs
    assert outputs["skipped"].startswith(f"DPO skipped: {pairs} pairs") and "dpo.min_pairs=1000" in outputs["skipped"]
    assert f"DPO skipped: {pairs} pairs" in out
    report = json.loads((run_dir / "report.json").read_text())
    assert report["models"] == ["base", "sft"] and "sft->dpo" not in report["comparisons"]
