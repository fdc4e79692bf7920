"""benchmarks/tool_rl_rise.py end to end at a toy size: one JSON line whose fields add up (not whether the rise
happens: that takes the full-size run, whose figures are in docs/agentic.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.eval.sandbox import sandbox_support

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tool_rl_rise.py"
SUPPORTED, WHY = sandbox_support()


@pytest.mark.skipif(not SUPPORTED, reason=f"the python tool's sandbox is unavailable here: {WHY}")
def test_a_toy_run_prints_one_json_line_whose_figures_add_up(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--work-dir", str(tmp_path / "w"), "--threads", "1", "--hidden", "32",
         "--layers", "1", "--vocab", "320", "--sft-examples", "40", "--tool-share", "0.25", "--sft-steps", "3",
         "--sft-batch", "4", "--grpo-steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--rl-prompts", "8",
         "--eval-prompts", "6"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["benchmark"] == "tool_rl_rise" and result["machine"]["threads"] == 1 and result["tiers"] == [1]
    assert result["model"]["hidden"] == 32 and result["model"]["parameters"] > 0
    sft, grpo, held = result["sft"], result["grpo"], result["held_out"]
    assert sft["with_tool"] == round(40 * 0.25) and sft["steps"] == 3 and sft["loss_first"] > 0
    assert grpo["episodes"] == 2 * 2 * 2 and grpo["steps"] == 2
    assert held["prompts"] == 6
    for name in ("reward", "tool_call_rate"):
        for side in ("before", "after"):
            value = held[f"{name}_{side}"]
            assert 0.0 <= value <= 1.0 and math.isclose(value * 6, round(value * 6))  # a share of 6 episodes
    for name, test in (("reward", held["reward_test"]), ("tool_call_rate", held["tool_call_test"])):
        # the paired test's figures are in points, of the same rows the rates come from
        assert math.isclose(test["base"], 100 * held[f"{name}_before"], abs_tol=1e-9)
        assert math.isclose(test["new"], 100 * held[f"{name}_after"], abs_tol=1e-9)
        assert math.isclose(test["delta"], test["new"] - test["base"], abs_tol=1e-9)
        assert test["ci_low"] <= test["delta"] <= test["ci_high"] and 0.0 < test["p_value"] <= 1.0
        assert test["n"] == 6 and test["exact"] and test["significant"] == (test["p_value"] <= 0.05)
    # the GRPO run's own end-of-run evaluation saw the same greedy episodes as the script's "after"
    logged = held["grpo_logged_eval"]
    assert logged["eval/prompts"] == 6
    assert math.isclose(logged["eval/reward"], held["reward_after"], abs_tol=1e-9)
    assert math.isclose(logged["eval/tool_call_rate"], held["tool_call_rate_after"], abs_tol=1e-9)
    walls = result["wall_s"]
    parts = ("prepare_s", "sft_s", "eval_before_s", "grpo_s", "eval_after_s")
    assert all(walls[p] >= 0 for p in parts) and walls["total_s"] >= sum(walls[p] for p in parts) - 0.05
