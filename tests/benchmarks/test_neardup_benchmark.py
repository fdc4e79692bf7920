"""benchmarks/neardup.py --smoke: it runs and prints its one JSON line (figures: benchmarks/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "neardup.py"


def test_neardup_prints_one_json_line():
    pytest.importorskip("datasketch", reason="the comparison needs datasketch (pip install 'posttrain[bench]')")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = proc.stdout.strip().splitlines()
    result = json.loads(line)
    assert result["benchmark"] == "neardup" and result["long"]["docs"] == 800
    assert result["long"]["ours"]["pairs"] > 0 and result["long"]["ours_pool_2"]["same_pairs"]
    assert result["short_real"]["edits"] > 100 and [s["docs"] for s in result["scale"]] == [2000, 5000]
    assert set(result["goal_met"]) == {"long_10x_wall", "long_10x_wall_whole_process", "long_recall_precision_0.97",
                                       "short_recall_0.9_precision_0.95"}
    assert result["long"]["ours_process"]["same_clusters"] and result["long"]["ours_process"]["seconds_median"] > 0
