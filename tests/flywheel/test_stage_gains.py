"""benchmarks/stage_gains.py: a finished round's comparisons repeated on suites drawn with other seeds (issue #28).
On the reduced round (a few items per cell): the line's shape and that its own-seed verdicts are the run's."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import stage_gains  # noqa: E402


def test_the_run_s_comparisons_are_repeated_on_another_seed_s_suite(finished_run, tmp_path):
    run_dir, _ = finished_run
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert stage_gains.main(["--run-dir", str(run_dir), "--seeds", "3", "--threads", "1",
                                 "--out", str(tmp_path)]) == 0
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1
    result = json.loads(lines[0])
    own = json.loads((run_dir / "compare" / "comparisons.json").read_text())
    run_verdicts, seed_verdicts = result["per_seed"]["run (seed 0)"], result["per_seed"]["seed 3"]
    assert result["items_per_group"] == 3 * 2  # the reduced suite: 2 items per (group, tier) cell
    assert list(seed_verdicts) == [name for name in ("base->sft", "sft->dpo", "dpo->grpo") if name in own]
    assert run_verdicts["base->sft"]["composite_delta"] == round(own["base->sft"]["composite"]["delta"], 2)
    for name, verdict in seed_verdicts.items():
        test = verdict["tests"]["composite"] if verdict["target"] == "composite" else None
        if test is not None:
            assert verdict["holds"] == (test["significant"] and test["delta"] > 0)
        assert result["holds_on_every_suite"][name] == (verdict["holds"] and run_verdicts[name]["holds"])
    redrawn = json.loads((tmp_path / "seed3-sft.json").read_text())
    assert len(redrawn["items"]) == 3 * 3 * 2 and redrawn["config"]["seed"] == 3


def block(delta: float, significant: bool) -> dict:
    return {"delta": delta, "ci_low": delta - 1, "ci_high": delta + 1, "p_adjusted": 0.01 if significant else 0.5,
            "significant": significant, "n_changed": 40, "too_few_items": False}


def test_a_stage_holds_only_when_every_target_measure_is_a_significant_gain():
    comparison = {"composite": block(0.4, False),
                  "groups": {"instruction_following": block(3.0, True), "reasoning": block(-2.0, True)}}
    assert stage_gains.verdict(comparison, ["instruction_following"])["holds"]
    assert not stage_gains.verdict(comparison, ["instruction_following", "reasoning"])["holds"]  # a loss
    assert not stage_gains.verdict(comparison, None)["holds"]  # the composite did not move significantly
    assert stage_gains.verdict(comparison, None)["groups"] == {"instruction_following": 3.0, "reasoning": -2.0}
