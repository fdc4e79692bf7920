"""The progress helper: a few whole lines in a log, nothing for quick work or when off, counts kept either way."""

from __future__ import annotations

import io

from posttrain.progress import QUIET_S, LineProgress, progress


def _clock(monkeypatch, times):
    """``time.monotonic`` returns ``times`` in turn (the constructor reads it once, then every update and close)."""
    ticks = iter(float(t) for t in times)
    monkeypatch.setattr("posttrain.progress.time.monotonic", lambda: next(ticks))


def test_lines_every_ten_percent_and_a_final_line():
    out = io.StringIO()
    bar = LineProgress(range(100), desc="work", unit="item", file=out, every_s=1e9, quiet_s=0)
    assert sum(1 for _ in bar) == 100
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and all(line.startswith("[posttrain] work: ") for line in lines)
    assert "100/100 item" in lines[-1] and "ETA" in lines[0]
    assert "\r" not in out.getvalue()


def test_quick_work_prints_nothing_in_a_log(monkeypatch):
    # 100 items, all done within the quiet period: no line at all, not even the final one.
    _clock(monkeypatch, [0.0] + [QUIET_S * i / 200 for i in range(1, 102)])
    out = io.StringIO()
    assert sum(1 for _ in LineProgress(range(100), desc="verify", unit="item", file=out)) == 100
    assert out.getvalue() == ""


def test_work_longer_than_the_quiet_period_is_reported_and_closed(monkeypatch):
    # One item per second over 20 s: silent for the first QUIET_S seconds, then a line per 10%, then the final line.
    _clock(monkeypatch, range(22))
    out = io.StringIO()
    bar = LineProgress(total=20, desc="generate", unit="seq", file=out, every_s=1e9)
    for _ in range(20):
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    counts = [int(line.split("/")[0].split()[-1]) for line in lines]
    # The first update at the end of the quiet period (5 s), then every 10% (2 items), then the final line.
    assert QUIET_S == 5 and counts == [5, 7, 9, 11, 13, 15, 17, 19, 20]
    assert "done in 21s" in lines[-1] and all("done in" not in line for line in lines[:-1])


def test_one_long_item_still_gets_its_final_line(monkeypatch):
    _clock(monkeypatch, [0, QUIET_S + 60, QUIET_S + 60])
    out = io.StringIO()
    bar = LineProgress(total=1, desc="load", file=out)
    bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "1/1 it" in lines[0] and "done in 1m05s" in lines[0]


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
    with progress(total=3, desc="manual", unit="step", quiet_s=0) as bar:  # a training loop's: no quiet period
        bar.set_postfix({"loss": "1.5"})
        bar.update(3)
    err = capsys.readouterr().err
    assert "3/3 step" in err and "loss=1.5" in err
    with progress(total=3, desc="quick", unit="step") as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""


def test_loading_a_model_draws_no_transformers_bar_in_a_log(tiny_model_dir):
    """The first model load of a run in a log (sft, dpo, grpo) drew transformers' carriage-return
    "Loading weights" bar; posttrain's loader turns transformers' bars off outside a terminal."""
    import os
    import subprocess
    import sys

    code = f"from posttrain.models.load import load_model; load_model({tiny_model_dir!r}); print('loaded')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "POSTTRAIN_PROGRESS": "lines", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "loaded", proc.stderr[-2000:]
    assert "Loading weights" not in proc.stderr and "\r" not in proc.stderr, proc.stderr[-500:]
