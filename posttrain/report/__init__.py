"""``posttrain report``: one self-contained HTML report (plotly.js inlined, no network) for any run.

``write_report(path)`` tells from the files what ``path`` holds (``detect``: a flywheel run, a training
run of any recipe, a curate / sample output, eval results), reads the numbers from those files
(``collect``), lays out tables and charts (``build``, ``tables``, ``figures``) and writes the page and
its numbers (``page``): ``report.html`` and ``report.json`` in the run directory unless ``out`` is given.
A run in object storage (``s3://…``) is reported from a local copy of its small files (``remote``).
The flywheel writes its report through the same function.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def default_output(path: Path) -> Path:
    """``<dir>/report.html`` for a directory, ``<stem>.report.html`` beside a results file."""
    return path / "report.html" if path.is_dir() else path.with_name(f"{path.stem}.report.html")


def write_report(path: str | Path, out: Path | None = None, *, kind: str | None = None,
                 timings: dict[str, float] | None = None, models: list[str] | None = None) -> dict[str, Any]:
    """Draw the report of ``path``; return ``{"kind", "html", "json", "charts", "summary"}``.

    ``path`` may be a URL (``s3://bucket/run``): the files a report reads are fetched into a temporary copy
    (``report.remote``) and the page is written to ``out`` or ``./<run name>.report.html``, not into the store.
    ``kind`` skips the detection (the flywheel knows what it wrote); ``timings`` and ``models`` are the
    flywheel's own (else read from each stage's ``stage.json`` and the ``eval_*`` directories)."""
    from posttrain.data.storage import is_remote

    if is_remote(str(path)):
        from posttrain.report.remote import default_remote_output, fetch_report_files

        url = str(path).rstrip("/")
        with tempfile.TemporaryDirectory(prefix="posttrain-report-") as scratch:
            local = fetch_report_files(url, Path(scratch))
            return _write(local, Path(out) if out else default_remote_output(url), kind, timings, models, url)
    path = Path(path)
    return _write(path, Path(out) if out else default_output(path), kind, timings, models, None)


def _write(path: Path, out: Path, kind: str | None, timings: dict[str, float] | None, models: list[str] | None,
           shown_as: str | None) -> dict[str, Any]:
    from posttrain.report import build
    from posttrain.report.detect import detect
    from posttrain.report.page import write_page

    kind = kind or detect(path)
    if kind == "flywheel":
        page, data = build.flywheel_page(path, timings, models, shown_as)
    elif kind == "training":
        page, data = build.training_page(path, shown_as)
    elif kind == "curate":
        page, data = build.curate_page(path, shown_as)
    else:
        page, data = build.eval_page(path, shown_as)
    written = write_page(page, data, out)
    return {"kind": data["kind"], **written, "charts": page.chart_count(), "summary": data.get("summary", [])}
