"""A reduced quickstart runs end to end, skips unchanged stages on re-run, and resumes after a crash."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from posttrain.cli import main
from tests.flywheel.reduced import ROOT, reduced_recipe


def stage_keys(run_dir):
    return {p.parent.name: json.loads(p.read_text())["key"] for p in run_dir.glob("*/stage.json")}


def test_round_produces_every_stage_and_a_complete_report(finished_run):
    run_dir, _ = finished_run
    expected = {"data", "base", "curate", "sft", "sample", "dpo", "eval_base", "eval_sft", "eval_dpo", "compare"}
    assert set(stage_keys(run_dir)) == expected
    funnel = json.loads((run_dir / "curate" / "funnel.json").read_text())
    assert funnel["input"] == funnel["kept"] + funnel["dropped"] == 120
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["scores"]) == {"base", "sft", "dpo"}
    assert set(report["comparisons"]) == {"base->sft", "sft->dpo", "base->dpo"}
    assert report["sft"]["step"] and report["dpo"]["step"] and report["sft"]["tiers"]
    html = (run_dir / "report.html").read_text()
    # Scores, the funnel, SFT curves and tier mix, DPO curves, tier mix and preference margin / accuracy.
    assert html.count('class="plotly-graph-div"') == 7
    for model in ("base", "sft", "dpo"):
        assert (run_dir / f"eval_{model}" / "results.json").exists()


def test_rerun_skips_every_unchanged_stage(finished_run, capsys):
    run_dir, recipe = finished_run
    before = stage_keys(run_dir)
    mtime = (run_dir / "sft" / "final" / "model.safetensors").stat().st_mtime
    assert main(["flywheel", "--config", str(recipe)]) == 0
    err = capsys.readouterr().err
    assert err.count("unchanged") == len(before)
    assert stage_keys(run_dir) == before
    assert (run_dir / "sft" / "final" / "model.safetensors").stat().st_mtime == mtime


def test_changed_stage_config_reruns_it_and_what_depends_on_it(finished_run, capsys):
    run_dir, recipe = finished_run
    data = yaml.safe_load(recipe.read_text())
    data["dpo"]["overrides"]["dpo.beta"] = 0.2
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    before = stage_keys(run_dir)
    assert main(["flywheel", "--config", str(recipe)]) == 0
    after = stage_keys(run_dir)
    unchanged = {name for name in before if before[name] == after[name]}
    assert unchanged == {"data", "base", "curate", "sft", "sample", "eval_base", "eval_sft"}
    assert "eval_dpo: running" in capsys.readouterr().err


def test_the_rl_stage_adds_grpo_to_the_round_and_the_report(finished_run, capsys):
    run_dir, recipe = finished_run
    data = yaml.safe_load(recipe.read_text())
    data["grpo"]["enabled"] = True
    data["grpo"]["eval_prompts"] = 4
    data["grpo"]["overrides"].update({"train.max_steps": 2, "train.global_batch_size": 4, "train.batch_size": 8,
                                      "train.max_length": 96, "train.eval_every": 1, "train.save_every": None,
                                      "rl.group_size": 4, "rl.max_new_tokens": 6, "rl.rollout_batch_size": 16,
                                      "reward.workers": 0})
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    before = stage_keys(run_dir)
    assert main(["flywheel", "--config", str(recipe)]) == 0
    after = stage_keys(run_dir)
    assert {name for name in after if before.get(name) != after[name]} == {"grpo", "eval_grpo", "compare"}
    report = json.loads((run_dir / "report.json").read_text())
    assert report["models"] == ["base", "sft", "dpo", "grpo"] and "dpo->grpo" in report["comparisons"]
    assert report["grpo"]["step"] == [0, 1] and report["grpo"]["eval"]["step"]
    prompts = [json.loads(line) for line in (run_dir / "grpo" / "prompts.jsonl").read_text().splitlines()]
    assert prompts and {p["group"] for p in prompts} == set(data["grpo"]["groups"])
    # The report says what each stage is judged on: SFT and DPO the composite, GRPO the groups of its prompts.
    targets = report["targets"]
    assert list(targets) == ["base->sft", "sft->dpo", "dpo->grpo"]
    assert targets["dpo->grpo"]["groups"] == sorted(data["grpo"]["groups"]) and targets["sft->dpo"]["groups"] is None
    html = (run_dir / "report.html").read_text()
    assert "What each stage targeted" in html and f"group {data['grpo']['groups'][0]}" in html
    assert html.count('class="plotly-graph-div"') == 9 and 'id="chart-grpo-rl"' in html


def test_crash_mid_sft_resumes_on_rerun(tmp_path):
    run_dir = tmp_path / "run"
    recipe = reduced_recipe(run_dir)
    data = yaml.safe_load(recipe.read_text())
    crashing = dict(data)
    crashing["sft"] = {**data["sft"], "overrides": {**data["sft"]["overrides"], "debug.crash_at_step": 2}}
    crash_recipe = tmp_path / "crash.yaml"
    crash_recipe.write_text(yaml.safe_dump(crashing, sort_keys=False))
    command = [sys.executable, "-m", "posttrain", "flywheel", "--config"]
    crashed = subprocess.run([*command, str(crash_recipe)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert crashed.returncode == -9
    assert (run_dir / "base" / "stage.json").exists() and not (run_dir / "sft" / "stage.json").exists()
    assert any((run_dir / "sft" / "checkpoints").glob("step-*/manifest.json"))
    resumed = subprocess.run([*command, str(recipe)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "base: unchanged" in resumed.stderr
    alerts = [json.loads(line) for line in (run_dir / "sft" / "alerts.jsonl").read_text().splitlines()]
    assert any(a["kind"] == "resumed" for a in alerts)
    assert (run_dir / "report.html").exists()
