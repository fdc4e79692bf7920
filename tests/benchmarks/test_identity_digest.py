"""benchmarks/identity_digest.py on 16 MiB: it runs and prints its one JSON line (figures: benchmarks/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "identity_digest.py"


def test_identity_digest_prints_one_json_line():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--gib", "0.015625", "--files", "2", "--repeats", "2"],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = proc.stdout.strip().splitlines()
    result = json.loads(line)
    assert result["benchmark"] == "identity_digest" and result["bytes"] >= 16 * 2**20 and result["files"] == 3
    assert result["full_read_gb_per_s"] > 0 and result["speedup"] > 0 and result["full_read_s_at_140_gb"] > 0
