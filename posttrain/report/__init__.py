"""``posttrain report``: one self-contained HTML report (plotly.js inlined, no network) for any run.

``write_report(path)`` tells from the files what ``path`` holds (``detect``: a flywheel run, a training
run of any recipe, a curate / sample output, eval results), reads the numbers from those files
(``collect``), lays out tables and charts (``build``, ``tables``, ``figures``) and writes the page and
its numbers (``page``): ``report.html`` and ``report.json`` in the run directory unless ``out`` is given.
The flywheel writes its report through the same function.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def default_output(path: Path) -> Path:
    """``<dir>/report.html`` for a directory, ``<stem>.report.html`` beside a results file."""
    return path / "report.html" if path.is_dir() else path.with_name(f"{path.stem}.report.html")


def write_report(path: Path, out: Path | None = None, *, kind: str | None = None,
                 timings: dict[str, float] | None = None, models: list[str] | None = None) -> dict[str, Any]:
    """Draw the report of ``path``; return ``{"kind", "html", "json", "charts", "summary"}``.

    ``kind`` skips the detection (the flywheel knows what it wrote); ``timings`` and ``models`` are the
    flywheel's own (else read from each stage's ``stage.json`` and the ``eval_*`` directories)."""
    from posttrain.report import build
    from posttrain.report.detect import detect
    from posttrain.report.page import write_page

    path = Path(path)
    kind = kind or detect(path)
    if kind == "flywheel":
        page, data = build.flywheel_page(path, timings, models)
    elif kind == "training":
        page, data = build.training_page(path)
    elif kind == "curate":
        page, data = build.curate_page(path)
    else:
        page, data = build.eval_page(path)
    written = write_page(page, data, Path(out) if out else default_output(path))
    return {"kind": data["kind"], **written, "charts": page.chart_count(), "summary": data.get("summary", [])}
