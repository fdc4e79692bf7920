"""benchmarks/grpo_staleness.py end to end on the tiny model: one JSON line, the lag it claims, the ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_staleness.py"


def test_a_tiny_run_prints_one_json_line_with_the_lag(tiny_model_dir, tmp_path):
    from posttrain.data.io import write_records
    from posttrain.tasks.emit import rl_prompts

    data = tmp_path / "prompts.jsonl"
    write_records(str(data), rl_prompts(16, 3, groups=["reasoning"]))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", tiny_model_dir, "--data", str(data), "--steps", "2",
                           "--warmup-steps", "1", "--max-new-tokens", "4", "--prompts-per-step", "2",
                           "--variants", "sync_unmeasured,sync,k1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    variants = result["variants"]
    assert set(variants) == {"sync_unmeasured", "sync", "k1"} and result["engine"] == "hf"
    assert [variants[name]["max_staleness_seen"] for name in ("sync", "k1")] == [0, 1]
    assert all(v["steps_timed"] == 2 and v["median_step_s"] > 0 for v in variants.values())
    assert variants["sync_unmeasured"]["median_recompute_s"] is None
    assert set(result["ratios"]) == {"k1_over_sync", "k1_over_sync_cpu", "measured_over_unmeasured",
                                     "measured_over_unmeasured_cpu"}


def test_the_engine_variants_run_against_an_engine_of_their_own(tiny_model_dir, tmp_path):
    """``--engine vllm``: three variants, each with its own engine (here the stdlib stand-in for vLLM's server, so
    the plumbing is tested in seconds; the figures in benchmarks/README.md are the real engine's)."""
    from posttrain.data.io import write_records
    from posttrain.tasks.emit import rl_prompts
    from tests.generate.test_vllm_server import fake_engine_python

    data = tmp_path / "prompts.jsonl"
    write_records(str(data), rl_prompts(16, 3, groups=["reasoning"]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POSTTRAIN_VLLM_PYTHON": fake_engine_python(tmp_path),
           "FAKE_VLLM_STARTS": str(tmp_path / "starts.txt")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--engine", "vllm", "--model", tiny_model_dir, "--data",
                           str(data), "--steps", "2", "--warmup-steps", "1", "--max-new-tokens", "4",
                           "--prompts-per-step", "2", "--no-measure-mismatch", "--pin"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    variants = result["variants"]
    assert set(variants) == {"sync", "k1_serial", "k1"} and result["engine"] == "vllm"
    assert [variants[name]["max_staleness_seen"] for name in ("sync", "k1_serial", "k1")] == [0, 1, 1]
    assert all(v["median_recompute_s"] is None and v["median_rollout_wait_s"] is not None for v in variants.values())
    assert {"k1_over_sync", "k1_over_k1_serial"} <= set(result["ratios"]) and result["measure_mismatch"] is False
    assert result["pinned"] is True
    assert len((tmp_path / "starts.txt").read_text().splitlines()) == 3  # one engine per variant
