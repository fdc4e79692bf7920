"""benchmarks/grpo_throughput.py: the figures' arithmetic, the shared reward and prompts, a tiny end-to-end run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "grpo_throughput.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("grpo_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gate(bench, durations):
    """A StepGate whose spans last ``durations`` (wall, cpu) seconds each."""
    gate = bench.StepGate.__new__(bench.StepGate)
    gate.spans, clock = [], 0.0
    for wall, cpu in durations:
        gate.spans.append(((clock, clock), (clock + wall, clock + cpu)))
        clock += 100.0
    return gate


def test_step_figures_use_the_median_of_the_timed_steps():
    bench = _load_script()
    # Step 0 is warm-up: its 50 s and its 10 tokens must not count.
    gate = _gate(bench, [(50.0, 1.0), (2.0, 3.0), (4.0, 5.0), (1.0, 6.0)])
    figures = bench.step_figures(gate, warmup=1, prompts_per_step=8, completion_tokens=[10, 100, 200, 300])
    assert figures["steps_timed"] == 3
    assert figures["median_step_s"] == 2.0
    assert figures["prompts_per_s"] == pytest.approx(8 / 2.0)
    assert figures["completion_tokens_per_s"] == pytest.approx(200 / 2.0)
    assert figures["step_cpu_s"] == [3.0, 5.0, 6.0]
    assert figures["step_prompts"] == [8, 8, 8]
    with pytest.raises(RuntimeError, match="token counts"):
        bench.step_figures(gate, warmup=1, prompts_per_step=8, completion_tokens=[10, 100, 200])


def _run(times, rss, prompts=8):
    return {"prompts_per_s": prompts / sorted(times)[len(times) // 2], "step_times_s": times, "step_cpu_s": times,
            "step_prompts": [prompts] * len(times), "mean_completion_tokens_per_step": 64.0, "peak_rss_mb": rss,
            "tree_peak_rss_mb": 2 * rss,
            "reward_mean": [0.5], "zero_signal_group_share": [0.25]}


def test_repeats_pool_into_one_median_and_the_ratios_follow():
    bench = _load_script()
    ours = [_run([1.0, 2.0, 3.0], 500.0), _run([1.0, 1.0, 1.0], 520.0)]
    theirs = [_run([4.0, 4.0, 8.0], 1000.0), _run([3.0, 6.0, 6.0], 900.0)]
    pooled = {"posttrain": bench.combine(ours), "trl": bench.combine(theirs)}
    # Pooled medians: ours of [1, 2, 3, 1, 1, 1] = 1.0, theirs of [4, 4, 8, 3, 6, 6] = 5.0; RSS the largest.
    assert pooled["posttrain"]["median_step_s"] == 1.0 and pooled["trl"]["median_step_s"] == 5.0
    assert pooled["posttrain"]["prompts_per_s"] == 8.0 and pooled["trl"]["prompts_per_s"] == 1.6
    assert pooled["posttrain"]["peak_rss_mb"] == 520.0 and pooled["trl"]["peak_rss_mb"] == 1000.0
    assert pooled["posttrain"]["zero_signal_group_share"] == 0.25
    ratios = bench.ratios(pooled, {"posttrain": ours, "trl": theirs}, "interleaved")
    assert ratios["prompts_per_s"] == 5.0
    assert ratios["prompts_per_s_per_repeat"] == [2.0, 6.0]  # medians 2 vs 4, then 1 vs 6
    assert ratios["peak_rss"] == 0.52
    assert ratios["tree_peak_rss"] == 0.52  # 1040 / 2000
    # Round by round: 4/1, 4/2, 8/3, 3/1, 6/1, 6/1 -> median of [4, 2, 2.667, 3, 6, 6] = 3.5.
    assert ratios["prompts_per_s_paired"] == 3.5


def test_trl_reward_scores_with_posttrain_rewards():
    bench = _load_script()
    from posttrain.data.records import RLPrompt, user
    from posttrain.rl.rewards import RewardConfig, RewardFunction

    record = RLPrompt(prompt=[user("What is 8 - 4?")], answer="4", verifier="numeric",
                      meta={"verifier_options": {"tolerance": 0}}).model_dump_json()
    completions = [[{"role": "assistant", "content": "The answer is 4."}],
                   [{"role": "assistant", "content": "5"}],
                   "4"]  # a plain-text completion (non-conversational prompts)
    with RewardFunction(RewardConfig(workers=0)) as reward_function:
        assert bench.trl_reward(reward_function)(completions, [record] * 3) == [1.0, 0.0, 1.0]


def test_both_frameworks_get_the_same_prompt_token_ids(tiny_model_dir):
    bench = _load_script()
    from posttrain.tasks.emit import rl_prompts

    check = bench.prompt_token_check(tiny_model_dir, rl_prompts(24, seed=0))
    assert check["same_prompt_ids"] is True
    assert check["mean_prompt_tokens"] > 5  # the template's role tokens plus the question


@pytest.mark.slow
def test_tiny_run_of_both_frameworks_prints_one_json_line(tiny_model_dir, tmp_path):
    from posttrain.data.io import write_records
    from posttrain.tasks.emit import rl_prompts

    data = tmp_path / "prompts.jsonl"
    write_records(data, rl_prompts(32, seed=0))
    proc = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--model", tiny_model_dir, "--data", str(data),
            "--work-dir", str(tmp_path / "work"), "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--steps", "2", "--warmup-steps", "1", "--repeats", "1", "--threads", "1",
        ],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    report = json.loads(lines[0])
    for name in ("posttrain", "trl"):
        figures = report["frameworks"][name]
        assert figures["steps_timed"] == 2
        assert figures["prompts_per_s"] == pytest.approx(2 / figures["median_step_s"], rel=1e-2)
        assert figures["peak_rss_mb"] > 0
        # The tree adds the two reward pool workers to the run's own process.
        assert figures["tree_peak_rss_mb"] > figures["peak_rss_mb"]
        # 2 prompts x G=2 completions of at most 4 tokens per step.
        assert 0 < figures["mean_completion_tokens_per_step"] <= 2 * 2 * 4
    assert report["same_prompt_ids"] is True
    ours, theirs = report["frameworks"]["posttrain"], report["frameworks"]["trl"]
    assert report["ratios"]["prompts_per_s"] == pytest.approx(ours["prompts_per_s"] / theirs["prompts_per_s"], rel=1e-2)
