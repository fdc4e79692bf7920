"""The flywheel report's score-jump section: verdicts that agree with their intervals, and how to read them."""

from __future__ import annotations

import json
import re

import numpy as np

from posttrain.eval.stats import capability_scores, compare_results
from posttrain.flywheel.report import READING_THE_VERDICTS, build_report

GROUPS = ("instruction_following", "reasoning", "transformation")


def eval_results(scores: dict[str, np.ndarray]) -> dict:
    items = [{"id": f"{g}-{i}", "group": g, "tier": 1 + i % 3, "score": float(s)}
             for g in GROUPS for i, s in enumerate(scores[g])]
    computed = capability_scores(items, n_boot=200)
    return {"items": items, "weights": computed.pop("weights"), "scores": computed}


def test_report_states_verdicts_that_agree_with_their_intervals(tmp_path):
    # The demo round of issue #11: reasoning gained 5 of 120 items (+4.2 points), which the old report
    # printed as "95% CI [+1.6, +8.3], p=0.0670 Holm-adjusted: not significant".
    rng = np.random.default_rng(0)
    base = {g: (rng.random(120) < 0.3).astype(float) for g in GROUPS}
    base["reasoning"] = np.zeros(120)
    sft = {g: v.copy() for g, v in base.items()}
    sft["instruction_following"][np.flatnonzero(base["instruction_following"] == 0)[:30]] = 1.0
    sft["reasoning"][:5] = 1.0
    runs = {"base": eval_results(base), "sft": eval_results(sft), "dpo": eval_results(sft)}
    for model, results in runs.items():
        (tmp_path / f"eval_{model}").mkdir()
        (tmp_path / f"eval_{model}" / "results.json").write_text(json.dumps(results))
    (tmp_path / "compare").mkdir()
    comparisons = {"base->sft": compare_results(runs["base"], runs["sft"], n_perm=2000),
                   "sft->dpo": compare_results(runs["sft"], runs["dpo"], n_perm=2000)}
    (tmp_path / "compare" / "comparisons.json").write_text(json.dumps(comparisons))

    report = build_report(tmp_path, {"sft": 1.0})
    page = (tmp_path / "report.html").read_text()
    reasoning = next(line for line in report["summary"] if line.startswith("base->sft: group reasoning:"))
    assert "too few items to tell" in reasoning and "Holm" not in page
    low, high = (float(x) for x in re.search(r"CI[^\[]*\[([+-]?[\d.]+), ([+-]?[\d.]+)\]", reasoning).groups())
    assert low <= 0 <= high  # an interval that excludes 0 never sits beside "not significant"
    following = next(line for line in report["summary"] if line.startswith("base->sft: group instruction_following"))
    assert "a significant improvement" in following and "simultaneous CI over 3 groups" in following
    assert "no change on any item" in next(line for line in report["summary"] if line.startswith("sft->dpo: composite"))
    assert 'id="reading-verdicts"' in page and "too few items to tell" in READING_THE_VERDICTS.lower()
    assert json.loads((tmp_path / "report.json").read_text())["reading_the_verdicts"] == READING_THE_VERDICTS
