"""benchmarks/lora_throughput.py: a tiny end-to-end run of its three runs prints one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "lora_throughput.py"


@pytest.mark.slow
def test_tiny_run_of_lora_full_and_trl_lora_prints_one_json_line(tiny_model_dir, tmp_path):
    from posttrain.data.io import write_records
    from posttrain.data.samples import sample_sft_records

    data = tmp_path / "chats.jsonl"
    write_records(data, sample_sft_records(n=64, seed=0))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model_dir, "--data", str(data), "--work-dir", str(tmp_path / "w"),
         "--batch-size", "2", "--max-length", "128", "--steps", "1", "--warmup-steps", "0", "--threads", "1",
         "--rank", "4", "--target-modules", "q_proj,v_proj"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert set(report["runs"]) == {"posttrain_full", "posttrain_lora", "trl_lora"}
    # r × (in + out) for q and v of 2 layers of the 64-wide model (v: 32 out, 2 of 4 heads for keys/values).
    assert report["lora_trainable_parameters"] == 2 * 4 * ((64 + 64) + (64 + 32))
    for figures in report["runs"].values():
        assert figures["steps_timed"] == 1 and figures["tokens_per_s"] > 0 and figures["peak_rss_mb"] > 0
    # The same chats in every run: the same real tokens per step.
    tokens = {name: figures["mean_tokens_per_step"] for name, figures in report["runs"].items()}
    assert tokens["posttrain_full"] == tokens["posttrain_lora"]
    assert report["ratios"]["lora_over_full"]["tokens_per_s"] == pytest.approx(
        report["runs"]["posttrain_lora"]["tokens_per_s"] / report["runs"]["posttrain_full"]["tokens_per_s"], rel=1e-2)
    assert isinstance(report["target_met"], bool)
