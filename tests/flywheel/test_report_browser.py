"""The report renders in headless Chromium: every chart drew data and the page logged no errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from posttrain.flywheel.report import build_report

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("chromium is not installed: `make test` installs it (apt-get install chromium)")
    return path


def fake_run(run_dir: Path) -> None:
    """A run directory with the files the report reads, filled with plausible numbers."""
    def scores(shift: float) -> dict:
        groups = {g: {"score": 20 + shift + i * 5, "ci_low": 10 + shift + i * 5, "ci_high": 30 + shift + i * 5, "n": 30}
                  for i, g in enumerate(["reasoning", "instruction_following", "transformation"])}
        return {"groups": groups, "tiers": {}, "composite": {"score": 25 + shift, "ci_low": 20 + shift, "ci_high": 30 + shift}}

    for index, model in enumerate(("base", "sft", "dpo")):
        (run_dir / f"eval_{model}").mkdir(parents=True)
        (run_dir / f"eval_{model}" / "results.json").write_text(json.dumps({"scores": scores(15 * index), "items": []}))
    (run_dir / "compare").mkdir()
    delta = {"base": 1, "new": 2, "delta": 1, "ci_low": 0.5, "ci_high": 1.5, "p_value": 0.01, "significant": True}
    (run_dir / "compare" / "comparisons.json").write_text(json.dumps(
        {"base->sft": {"composite": delta, "groups": {}, "summary": ["composite: +15.0 points, significant"]}}))
    (run_dir / "curate").mkdir()
    (run_dir / "curate" / "funnel.json").write_text(json.dumps({"input": 100, "kept": 70, "dropped": 30, "stages": [
        {"stage": "filters", "in": 100, "kept": 80, "dropped": {"garbled": 20}},
        {"stage": "exact_dedup", "in": 80, "kept": 70, "dropped": {"duplicate": 10}}]}))
    for stage, extra in (("sft", lambda s: {f"tier_{1 + (s > 3) + (s > 6)}": 8}),
                         ("dpo", lambda s: {"rewards/margin": 0.1 * s, "rewards/accuracy": 0.5 + 0.05 * s})):
        (run_dir / stage).mkdir()
        rows = [{"step": s, "loss": 2.0 / (s + 1), "grad_norm": 1.0 + s / 10, **extra(s)} for s in range(10)]
        (run_dir / stage / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def render(html_path: Path, tmp_path: Path, shot_name: str) -> tuple[dict, str]:
    common = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000"]
    dom = subprocess.run([*common, "--dump-dom", html_path.as_uri()], capture_output=True, text=True, timeout=180)
    match = re.search(r'<pre id="render-check">(.*?)</pre>', dom.stdout, re.S)
    assert match, f"no render check in the DOM; chromium said: {dom.stderr[-2000:]}"
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / shot_name
    subprocess.run([*common, "--window-size=1200,3000", f"--screenshot={shot}", html_path.as_uri()],
                   capture_output=True, text=True, timeout=180)
    return json.loads(match.group(1)), dom.stderr


def test_report_renders_every_chart_without_errors(tmp_path):
    run_dir = tmp_path / "run"
    fake_run(run_dir)
    report = build_report(run_dir, {"sft": 1.0})
    verdict, stderr = render(Path(report["html"]), tmp_path, "report.png")
    # The funnel, SFT curves and tier mix, DPO curves and margin / accuracy, the scores: SFT and DPO each
    # have their own step axis.
    assert verdict["charts"] == 6, verdict
    assert verdict["with_data"] == verdict["charts"], verdict
    assert verdict["errors"] == [], verdict
    assert verdict["check_hidden"] is True  # the check's text is for the test, not for a reader
    assert "Uncaught" not in stderr
    assert (ARTIFACTS / "report.png").stat().st_size > 10_000
    numbers = json.loads(Path(report["json"]).read_text())
    assert numbers["scores"]["dpo"]["composite"]["score"] == 55


def test_broken_chart_is_detected(tmp_path):
    """The check can fail: a page whose plot throws reports the error and a chart without data."""
    run_dir = tmp_path / "run"
    fake_run(run_dir)
    report = build_report(run_dir, {})
    page = Path(report["html"])
    page.write_text(page.read_text().replace("</body>", "<script>throw new Error('boom')</script></body>"))
    verdict, _ = render(page, tmp_path, "report-broken.png")
    assert any("boom" in e for e in verdict["errors"])
