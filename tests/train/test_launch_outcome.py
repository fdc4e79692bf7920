"""How `posttrain launch` ends a failed group: 75 when it can resume (a stall, a preemption), 1 otherwise, and
only the final attempt's own marks count."""

from __future__ import annotations

import pytest

from posttrain.commands.launch import failure_outcome
from posttrain.exit_codes import LAUNCH_MARKS_ENV, mark_preempted, mark_stalled, read_launch_marks


@pytest.fixture
def marks_file(tmp_path, monkeypatch):
    path = tmp_path / "marks.jsonl"
    monkeypatch.setenv(LAUNCH_MARKS_ENV, str(path))
    return path


def test_a_stall_is_resumable_though_its_peers_died_with_1(marks_file):
    mark_stalled(rank=1, step=7, idle_s=3.04)
    [mark] = read_launch_marks(marks_file)
    pid = mark["pid"]
    assert mark == {"kind": "stalled", "pid": pid, "rank": 1, "step": 7, "idle_s": 3.0}
    code, line = failure_outcome({0: (pid + 1, 1), 1: (pid, 75)}, read_launch_marks(marks_file))
    assert code == 75
    assert "stalled: no progress on rank 1 at step 7" in line and "rank 0 exited with 1, rank 1 exited with 75" in line


def test_an_earlier_attempts_stall_does_not_make_a_real_failure_resumable(marks_file):
    mark_stalled(rank=0, step=2, idle_s=5.0)  # attempt 1; this process is not among the final attempt's workers
    stale_pid = read_launch_marks(marks_file)[0]["pid"]
    code, line = failure_outcome({0: (stale_pid + 10, 1), 1: (stale_pid + 11, 1)}, read_launch_marks(marks_file))
    assert (code, line) == (1, "posttrain launch: rank 0 exited with 1, rank 1 exited with 1 (see its output above)")


def test_preemption_by_exit_codes_or_by_a_mark(marks_file):
    assert failure_outcome({0: (100, 75), 1: (101, 75)}, [])[0] == 75
    mark_preempted(4)
    pid = read_launch_marks(marks_file)[0]["pid"]
    code, line = failure_outcome({0: (pid, 75), 1: (pid + 1, 1)}, read_launch_marks(marks_file))
    assert code == 75 and "preempted" in line and "stalled" not in line
    assert failure_outcome({0: (pid + 2, 75), 1: (pid + 1, 1)}, read_launch_marks(marks_file))[0] == 1


def test_a_torn_line_is_skipped_and_no_file_is_no_marks(marks_file):
    assert read_launch_marks(marks_file) == []
    mark_preempted(None)
    with open(marks_file, "a", encoding="utf-8") as handle:
        handle.write('{"kind": "sta')  # a worker killed mid-write
    assert [mark["kind"] for mark in read_launch_marks(marks_file)] == ["preempted"]


def test_without_the_launcher_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(LAUNCH_MARKS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    mark_stalled(rank=0, step=1, idle_s=1.0)
    mark_preempted(1)
    assert list(tmp_path.iterdir()) == []
