"""The benchmark scripts import their shared helpers as ``_harness`` from beside them, as ``python benchmarks/x.py`` does."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
