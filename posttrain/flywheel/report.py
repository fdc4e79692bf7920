"""The flywheel's report: ``report.html`` + ``report.json`` in the run directory, drawn by ``posttrain.report``
from the stages' own files (the same page ``posttrain report RUN_DIR`` draws later)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.report.tables import READING_THE_VERDICTS

__all__ = ["READING_THE_VERDICTS", "build_report"]


def build_report(run_dir: Path, timings: dict[str, float] | None = None,
                 models: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Write the run's report (read from the run directory alone); return ``{"html", "json", "summary", ...}``."""
    from posttrain.report import write_report

    return write_report(Path(run_dir), kind="flywheel", timings=timings, models=list(models) if models else None)
