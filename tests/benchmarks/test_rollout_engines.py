"""benchmarks/rollout_engines.py --smoke end to end against the stdlib stand-in for vLLM's server (through
``$POSTTRAIN_VLLM_PYTHON``), so the plumbing — both engines, both sync methods — runs in seconds; the figures in
benchmarks/README.md are the real engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout_engines.py"


def test_smoke_prints_one_json_line_with_both_sync_methods(tmp_path):
    from tests.generate.test_vllm_server import fake_engine_python

    reloads = tmp_path / "reloads.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POSTTRAIN_VLLM_PYTHON": fake_engine_python(tmp_path),
           "FAKE_VLLM_RELOADS": str(reloads)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["benchmark"] == "rollout_engines" and result["smoke"] is True and result["repeats"] == 1
    (row,) = result["models"]
    assert row["model"] == "tiny" and row["hf_tokens"] > 0 and row["vllm_tokens"] > 0
    assert row["sync_s"] > 0 and row["broadcast_sync_s"] > 0 and row["broadcast_over_file"] > 0
    # the same tensors both ways: the file adds its safetensors header
    assert 0 < row["sync_bytes"] - row["broadcast_bytes"] < 64 << 10
    assert [int(line) for line in reloads.read_text().splitlines()] == [row["sync_bytes"], row["broadcast_bytes"]]
