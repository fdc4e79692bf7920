"""benchmarks/feedback_load.py, bounded (20 clients, 5 s, SQLite): no error, no lost or duplicated row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "feedback_load.py"


def test_feedback_load_short_run_loses_and_duplicates_nothing():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--clients", "20", "--duration", "5", "--backend", "sqlite"],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    result = json.loads(lines[-1])
    figures = result["sqlite"]
    assert proc.returncode == 0 and result["ok"], figures
    assert figures["errors"] == 0 and figures["first_errors"] == []
    # the count check: what clients were told (201 / 200) is exactly what the database holds
    assert figures["rows"]["edge_cases"] == figures["acknowledged"]["edge_cases_201"] > 50
    assert figures["rows"]["votes"] == figures["acknowledged"]["votes_201"] > 0
    assert figures["acknowledged"]["reposts_200"] > 0 and figures["rows"]["responses"] == 2 * figures["rows"]["edge_cases"]
    assert figures["latency_ms"]["p50"] <= figures["latency_ms"]["p95"] <= figures["latency_ms"]["p99"]
