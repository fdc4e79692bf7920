"""`posttrain report PATH` on every kind of run directory, the page fixes, and a two-round flywheel run.

The flywheel, SFT, DPO, curate, sample and eval directories are the stage directories of the reduced
round the other flywheel tests run (``finished_run``); the RM and GRPO runs are 2-step runs on the
training tests' own inputs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.eval.stats import capability_scores, compare_results
from posttrain.report import figures
from tests.flywheel.test_report_browser import render
from tests.rl.conftest import grpo_overrides, rl_data  # noqa: F401 - fixture
from tests.train_preference.conftest import pref_data, pref_model_dir, rm_overrides  # noqa: F401 - fixtures


def report(path: Path, out: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["report", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    numbers = json.loads(out.with_suffix(".json").read_text())
    assert f"{numbers['kind']} report: {out}" in printed
    return numbers


def metric_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted({r["step"] for r in rows if "loss" in r})


def plot_data(page: str, name: str) -> list[dict]:
    """The traces plotly was given for the chart ``plot-<name>`` (the JSON passed to Plotly.newPlot)."""
    match = re.search(rf'Plotly\.newPlot\(\s*"plot-{re.escape(name)}",\s*(\[.*?\]),\s*\{{', page, re.S)
    assert match, f"no chart plot-{name} on the page"
    return json.loads(match.group(1))


def test_training_stage_directories_get_their_own_reports(finished_run, tmp_path, capsys):
    run_dir, _ = finished_run
    for stage, kind, charts in (("sft", "sft", {"sft-curves", "sft-tiers"}),
                                ("dpo", "dpo", {"dpo-curves", "dpo-tiers", "dpo-preference"})):
        out = tmp_path / f"{stage}.html"
        numbers = report(run_dir / stage, out, capsys)
        assert numbers["kind"] == kind and numbers["series"]["step"] == metric_steps(run_dir / stage)
        page = out.read_text()
        assert set(re.findall(r'id="plot-([\w-]+)"', page)) == charts
        assert numbers["finished"]["steps"] == json.loads((run_dir / stage / "finished.json").read_text())["steps"]


def test_curate_sample_and_eval_directories(finished_run, tmp_path, capsys):
    run_dir, _ = finished_run
    funnel = json.loads((run_dir / "curate" / "funnel.json").read_text())
    numbers = report(run_dir / "curate", tmp_path / "curate.html", capsys)
    assert numbers["kind"] == "curate" and numbers["funnel"] == funnel
    kept = [json.loads(line) for line in (run_dir / "curate" / "kept.jsonl").read_text().splitlines()]
    assert sum(numbers["kept_tiers"].values()) == len(kept) == funnel["kept"]
    bars = plot_data((tmp_path / "curate.html").read_text(), "funnel")
    assert bars[0]["x"] == [s["stage"] for s in funnel["stages"]]

    assert report(run_dir / "sample", tmp_path / "sample.html", capsys)["kind"] == "sample"

    results = json.loads((run_dir / "eval_sft" / "results.json").read_text())
    for path in (run_dir / "eval_sft", run_dir / "eval_sft" / "results.json"):
        numbers = report(path, tmp_path / "eval.html", capsys)
        assert numbers["kind"] == "eval" and numbers["scores"]["eval_sft"] == results["scores"]
    comparisons = json.loads((run_dir / "compare" / "comparisons.json").read_text())
    numbers = report(run_dir / "compare", tmp_path / "compare.html", capsys)
    assert set(numbers["comparisons"]) == set(comparisons)
    page = (tmp_path / "compare.html").read_text()
    delta = comparisons["base->sft"]["composite"]["delta"]
    assert f"<td>{delta:+.1f}</td>" in page if delta else "<td>0.0</td>" in page


def test_flywheel_run_report_sft_and_dpo_on_separate_axes(finished_run, tmp_path, capsys):
    run_dir, _ = finished_run
    out = tmp_path / "flywheel.html"
    numbers = report(run_dir, out, capsys)
    assert numbers["kind"] == "flywheel" and numbers["models"][:3] == ["base", "sft", "dpo"]
    page = out.read_text()
    for stage in ("sft", "dpo"):
        traces = plot_data(page, f"{stage}-curves")
        steps = metric_steps(run_dir / stage)
        assert all(t["x"] == steps for t in traces if t["name"] != "held-out loss")  # this stage's steps only
    assert metric_steps(run_dir / "sft") != metric_steps(run_dir / "dpo")
    # The comparisons are a table (one row per measure), not lines of prose above the charts.
    comparisons = json.loads((run_dir / "compare" / "comparisons.json").read_text())
    rows = page.count("<tr>") - page.count("<thead><tr>")
    measures = sum(1 + len(c["groups"]) + len(c["tiers"]) for c in comparisons.values())
    assert rows >= measures and "<ul>" not in page and "<details id=\"reading-verdicts\">" in page
    assert '<pre id="render-check">pending</pre>' in page and "#render-check{display:none}" in page


def test_accuracy_axes_are_capped_at_one():
    series = {"step": [0, 1, 2], "margin": [0.0, 0.5, 1.5], "accuracy": [0.5, 1.0, 1.0],
              "eval": {"step": [2], "accuracy": [1.0]}}
    fig = figures.preference_figure(series, "RM")
    assert list(fig.layout.yaxis2.range) == figures.UNIT_RANGE and figures.UNIT_RANGE[0] == 0
    assert figures.UNIT_RANGE[1] < 1.05
    rl = figures.rl_figure({"step": [0, 1], "reward": [0.1, 0.2], "pass_by_tier": {"tier_1": [0.0, 1.0]}}, "GRPO")
    assert list(rl.layout.yaxis2.range) == figures.UNIT_RANGE


def test_reward_model_and_grpo_runs(pref_model_dir, pref_data, rl_data, tiny_model_dir, tmp_path, capsys):  # noqa: F811
    rm_dir = tmp_path / "rm"
    assert main(["rm", *rm_overrides(pref_model_dir, pref_data, rm_dir, **{"train.max_steps": 2,
                                                                           "train.eval_every": 1})]) == 0
    numbers = report(rm_dir, tmp_path / "rm.html", capsys)
    logged = [json.loads(line) for line in (rm_dir / "metrics.jsonl").read_text().splitlines()]
    assert numbers["kind"] == "rm"
    assert numbers["series"]["accuracy"] == [r["accuracy"] for r in logged if "loss" in r]
    held_out = json.loads((rm_dir / "eval.json").read_text())
    assert numbers["series"]["eval_phases"] == held_out
    page = (tmp_path / "rm.html").read_text()
    assert "plot-rm-preference" in page and "Held-out set before and after training" in page

    grpo_dir = tmp_path / "grpo"
    assert main(["grpo", *grpo_overrides(tiny_model_dir, rl_data, grpo_dir, **{"train.max_steps": 2})]) == 0
    numbers = report(grpo_dir, tmp_path / "grpo.html", capsys)
    logged = [json.loads(line) for line in (grpo_dir / "metrics.jsonl").read_text().splitlines()]
    assert numbers["kind"] == "grpo" and numbers["series"]["reward"] == [r["reward_mean"] for r in logged if "loss" in r]
    assert "plot-grpo-rl" in (tmp_path / "grpo.html").read_text()


def test_a_directory_that_is_no_run_exits_2_with_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "other.json").write_text('{"a": 1}')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a run directory" in err and "metrics.jsonl" in err
    assert main(["report", str(tmp_path / "other.json")]) == 2
    assert "not a `posttrain eval` results" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert not (tmp_path / "report.html").exists()


# ------------------------------------------------------------------------------------------ two rounds


def rescored(results: dict, group: str, flips: int) -> dict:
    """``results`` with ``flips`` more items of ``group`` passed, scores recomputed from the items."""
    items = [dict(item) for item in results["items"]]
    for item in [i for i in items if i["group"] == group and i["score"] < 1][:flips]:
        item.update(score=1.0, passed=True)
    computed = capability_scores(items, weights=results["weights"], n_boot=200)
    computed.pop("weights", None)
    return {**results, "items": items, "scores": computed}


def two_round_run(source: Path, target: Path) -> dict:
    """Round 1 is the reduced round itself; round 2 copies its stages into ``round2/`` with a model-judge
    stage in its funnel, feedback stages with counts, and a final DPO model that passes 3 more reasoning
    items. Returns round 2's DPO results."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("checkpoints", "final", "init", "cache"))
    round2 = target / "round2"
    for stage in ("curate", "sft", "sample", "dpo", "eval_sft", "eval_dpo", "compare"):
        shutil.copytree(target / stage, round2 / stage)
    funnel = json.loads((round2 / "curate" / "funnel.json").read_text())
    last = funnel["stages"][-1]
    funnel["stages"].append({"stage": "model_judge", "in": last["kept"], "kept": last["kept"] - 4,
                             "dropped": {"judge_low_score": 4}})
    funnel.update(kept=funnel["kept"] - 4, dropped=funnel["dropped"] + 4)
    (round2 / "curate" / "funnel.json").write_text(json.dumps(funnel))
    for stage, counts in (("capture", {"captured": 12}), ("annotate", {"votes": 36}), ("export", {"pairs": 8}),
                          ("feedback", {"sft": 7})):
        (round2 / stage).mkdir()
        (round2 / stage / "stage.json").write_text(json.dumps({"key": "k", "outputs": {"counts": counts},
                                                               "seconds": 1.0}))
    round1_dpo = json.loads((target / "eval_dpo" / "results.json").read_text())
    round2_dpo = rescored(round1_dpo, "reasoning", 3)
    (round2 / "eval_dpo" / "results.json").write_text(json.dumps(round2_dpo))
    (target / "across").mkdir()
    across = {"round1/dpo->round2/dpo": compare_results(round1_dpo, round2_dpo, n_perm=500)}
    (target / "across" / "comparisons.json").write_text(json.dumps(across))
    (target / "rounds.json").write_text(json.dumps({"rounds": [
        {"round": 1, "dir": ".", "models": ["base", "sft", "dpo"], "final": "dpo"},
        {"round": 2, "dir": "round2", "models": ["sft", "dpo"], "final": "dpo", "captured_groups": ["reasoning"],
         "counts": {"captured": 12, "votes": 36, "pairs": 8, "sft": 7}}], "across": "across/comparisons.json"}))
    return round2_dpo


def test_two_rounds_side_by_side(finished_run, tmp_path, capsys):
    run_dir, _ = finished_run
    run = tmp_path / "run"
    round2_dpo = two_round_run(run_dir, run)
    out = tmp_path / "rounds.html"
    numbers = report(run, out, capsys)
    assert [r["round"] for r in numbers["rounds"]] == [1, 2]

    # Round 2's composite, by hand: the weighted mean of its groups' pass rates, in points.
    items, weights = round2_dpo["items"], round2_dpo["weights"]
    by_hand = sum(100 * w * sum(i["score"] for i in items if i["group"] == g) / sum(i["group"] == g for i in items)
                  for g, w in weights.items())
    final = numbers["rounds"][1]["final_scores"]
    assert final["composite"]["score"] == pytest.approx(by_hand)
    reasoning = [i for i in items if i["group"] == "reasoning"]
    assert final["groups"]["reasoning"]["score"] == pytest.approx(100 * sum(i["score"] for i in reasoning) / len(reasoning))

    page = out.read_text()
    summary = page[page.index("<h2>Rounds</h2>"):page.index('<section class="round">')]
    scores_table = summary[:summary.index("</table>")]
    assert "round 1 (dpo)" in scores_table and "round 2 (dpo)" in scores_table
    assert f"{final['composite']['score']:.1f} <small>[{final['composite']['ci_low']:.1f}" in scores_table
    assert re.search(r"reasoning <span class=\"mark\"", scores_table)
    across = numbers["across"]["round1/dpo->round2/dpo"]
    assert across["groups"]["reasoning"]["delta"] == pytest.approx(100 * 3 / len(reasoning))
    across_table = summary[summary.index("<h4>Across rounds</h4>"):]
    row = re.search(r"<tr><th></th><td>group reasoning <span class=\"mark\".*?</tr>", across_table).group(0)
    assert f"<td>{across['groups']['reasoning']['delta']:+.1f}</td>" in row
    assert "captured</th>" in summary and "<td>12</td>" in summary  # the feedback counts per round
    # Each round has its own section; round 2's funnel shows the model-judge stage, its feedback its counts.
    assert page.count('<section class="round">') == 2
    assert "model_judge" in plot_data(page, "r2-funnel")[0]["x"] and "captured 12" in page

    verdict, _ = render(out, tmp_path, "report-rounds.png")
    assert verdict["charts"] == verdict["with_data"] == page.count('class="plotly-graph-div"'), verdict
    assert verdict["errors"] == [] and verdict["check_hidden"] is True
