"""The alert rules: valid for promtool, every alert tested firing and not firing, one source for both files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from posttrain.telemetry.rules import render

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: `make promtool` installs it (Debian's prometheus package)"
    return subprocess.run([binary, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120)


def test_promtool_accepts_the_rules():
    proc = promtool("check", "rules", "alerts.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 7 rules found" in proc.stdout


def test_promtool_rule_tests_pass_and_cover_every_alert_firing_and_not():
    proc = promtool("test", "rules", "tests/alerts_test.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alerts = {rule["alert"] for group in yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())["groups"]
              for rule in group["rules"]}
    cases = [case for test in yaml.safe_load((PROMETHEUS / "tests" / "alerts_test.yaml").read_text())["tests"]
             for case in test["alert_rule_test"]]
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == alerts  # each fires somewhere
    assert {c["alertname"] for c in cases if not c["exp_alerts"]} == alerts  # and stays quiet somewhere


def test_the_prometheusrule_embeds_the_same_groups_and_is_regenerated():
    source = (PROMETHEUS / "alerts.yaml").read_text()
    committed = (PROMETHEUS / "prometheusrule.yaml").read_text()
    assert committed == render(source), ("deploy/prometheus/prometheusrule.yaml is stale: python -m "
                                         "posttrain.telemetry.rules deploy/prometheus/alerts.yaml "
                                         "deploy/prometheus/prometheusrule.yaml")
    rule = yaml.safe_load(committed)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(source)["groups"]
