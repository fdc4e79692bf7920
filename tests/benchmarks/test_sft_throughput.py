"""benchmarks/sft_throughput.py: the figures' arithmetic, and a tiny end-to-end run of both frameworks."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sft_throughput.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("sft_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_figures_use_the_median_of_the_timed_steps():
    bench = _load_script()
    gate = bench.StepGate.__new__(bench.StepGate)
    # (wall, cpu) at each step's start and end; step 0 is warm-up and must not count.
    durations = [(50.0, 1.0), (2.0, 3.0), (4.0, 5.0), (3.0, 6.0)]
    gate.spans, clock = [], 0.0
    for wall, cpu in durations:
        gate.spans.append(((clock, clock), (clock + wall, clock + cpu)))
        clock += 100.0
    tokens, loss_tokens = [1, 300, 600, 900], [1, 30, 60, 90]
    figures = bench._step_figures(gate, tokens, loss_tokens, warmup=1)
    assert figures["steps_timed"] == 3
    assert figures["median_step_s"] == 3.0
    assert figures["tokens_per_s"] == pytest.approx(600 / 3.0)
    assert figures["loss_tokens_per_s"] == pytest.approx(60 / 3.0)
    assert figures["step_cpu_s"] == [3.0, 5.0, 6.0]
    with pytest.raises(RuntimeError, match="token counts"):
        bench._step_figures(gate, tokens[:3], loss_tokens[:3], warmup=1)


@pytest.mark.slow
def test_tiny_run_of_both_frameworks_prints_one_json_line(tiny_model_dir, tmp_path):
    from posttrain.data.io import write_records
    from posttrain.data.samples import sample_sft_records

    data = tmp_path / "chats.jsonl"
    write_records(data, sample_sft_records(n=64, seed=0))
    proc = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--model", tiny_model_dir, "--data", str(data),
            "--work-dir", str(tmp_path / "work"), "--batch-size", "2", "--max-length", "128",
            "--steps", "2", "--warmup-steps", "1", "--threads", "1", "--ac", "none,full",
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
        assert figures["tokens_per_s"] > 0 and figures["peak_rss_mb"] > 0
        # Both train on the same chats: similar real tokens per packed row of 128.
        assert 0.5 * 2 * 128 < figures["mean_tokens_per_step"] <= 2 * 128
    assert set(report["activation_checkpointing"]) == {"none", "full"}
    assert report["ratios"]["tokens_per_s"] == pytest.approx(
        report["frameworks"]["posttrain"]["tokens_per_s"] / report["frameworks"]["trl"]["tokens_per_s"], rel=1e-2
    )
