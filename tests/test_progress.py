"""The progress helper: a few whole lines in a log, nothing when off, counts kept either way."""

from __future__ import annotations

import io

from posttrain.progress import LineProgress, progress


def test_lines_every_ten_percent_and_a_final_line(monkeypatch):
    out = io.StringIO()
    bar = LineProgress(range(100), desc="work", unit="item", file=out, every_s=1e9)
    assert sum(1 for _ in bar) == 100
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and all(line.startswith("[posttrain] work: ") for line in lines)
    assert "100/100 item" in lines[-1] and "ETA" in lines[0]
    assert "\r" not in out.getvalue()


def test_a_slow_job_reports_by_time_too(monkeypatch):
    out = io.StringIO()
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr("posttrain.progress.time.monotonic", lambda: next(clock))
    bar = LineProgress(total=10_000, desc="slow", file=out, every_s=5)
    for _ in range(20):
        bar.update(1)  # 0.2% of the work in 20 "seconds": reported by time, not by share
    assert len(out.getvalue().splitlines()) == 4


def test_off_prints_nothing_and_still_iterates(monkeypatch, capsys):
    monkeypatch.setenv("POSTTRAIN_PROGRESS", "off")
    assert list(progress(range(5), desc="quiet")) == list(range(5))
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("POSTTRAIN_PROGRESS", "lines")
    with progress(total=3, desc="manual", unit="step") as bar:
        bar.set_postfix({"loss": "1.5"})
        bar.update(3)
    err = capsys.readouterr().err
    assert "3/3 step" in err and "loss=1.5" in err
