"""The stall watchdog: a rank with no progress reports every thread's stack and exits 75; beats and pauses keep it
quiet; the hang drill on one process and on one of two ranks ends the run in bounded time, and a rerun resumes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from posttrain.config.sections import DebugConfig, HealthConfig
from posttrain.exit_codes import EXIT_RESUMABLE, LAUNCH_MARKS_ENV, read_launch_marks
from posttrain.train.health import Alerts
from posttrain.train.watchdog import STALL_EXIT_CODE, Watchdog, drill_step
from tests.train.conftest import ROOT, base_overrides, env, final_weights, read_jsonl, sft_command


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _stuck_in_a_collective(release: threading.Event) -> None:
    release.wait()


def test_a_stall_alerts_with_every_threads_stack_and_exits_resumable(tmp_path):
    exits: list[int] = []
    release = threading.Event()
    stuck = threading.Thread(target=_stuck_in_a_collective, args=(release,), name="trainer")
    stuck.start()
    try:
        with Watchdog(0.3, Alerts(tmp_path / "alerts.jsonl", echo=False), exit_process=exits.append) as dog:
            dog.beat("checkpoint save", 7)
            started = time.monotonic()
            assert wait_for(lambda: exits, timeout=5)
            waited = time.monotonic() - started
    finally:
        release.set()
        stuck.join()
    assert exits == [STALL_EXIT_CODE] == [EXIT_RESUMABLE]
    assert 0.3 <= waited < 0.3 + 0.5  # polled every timeout/10; the rest is slack for a busy machine
    [alert] = read_jsonl(tmp_path / "alerts.jsonl")
    assert alert["kind"] == "stalled" and (alert["rank"], alert["step"], alert["phase"]) == (0, 7, "checkpoint save")
    assert alert["seconds_since_progress"] >= 0.3 and alert["exit_code"] == 75
    [trainer] = [stack for name, stack in alert["stacks"].items() if name.startswith("trainer ")]
    assert "_stuck_in_a_collective" in trainer and "release.wait()" in trainer
    assert not any(name.startswith("posttrain-watchdog") for name in alert["stacks"])  # not its own stack


def test_beats_keep_it_quiet_a_pause_stops_the_clock_and_it_stays_armed_after(tmp_path):
    exits: list[int] = []
    with Watchdog(0.3, Alerts(tmp_path / "alerts.jsonl", echo=False), exit_process=exits.append) as dog:
        for step in range(10):  # 1 s of steps of 0.1 s: never 0.3 s without progress
            dog.beat("step", step)
            time.sleep(0.1)
        with dog.paused("upload", 10):
            time.sleep(0.8)  # longer than the timeout, inside a phase with a timeout of its own
        assert exits == []
        resumed = time.monotonic()
        assert wait_for(lambda: exits, timeout=5)  # the clock restarted at the end of the pause
        assert time.monotonic() - resumed >= 0.3
    assert read_jsonl(tmp_path / "alerts.jsonl")[0]["phase"] == "upload"


def test_no_timeout_no_thread(tmp_path):
    with Watchdog(None, Alerts(tmp_path / "alerts.jsonl")) as dog:
        dog.beat("step", 0)
        assert not any(t.name == "posttrain-watchdog" for t in threading.enumerate())
    assert HealthConfig(stall_timeout_s=None).stall_timeout_s is None
    assert HealthConfig().stall_timeout_s == 1800
    with pytest.raises(ValueError):
        HealthConfig(stall_timeout_s=0)


EXIT_PATH = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from posttrain.train.health import Alerts
    from posttrain.train.watchdog import Watchdog

    def wait_in_a_hung_collective():
        time.sleep(60)

    out = Path(sys.argv[1])
    with Watchdog(0.5, Alerts(out / "alerts.jsonl")) as dog:
        dog.beat("step", 3)
        wait_in_a_hung_collective()
    print("not reached")
""")


@pytest.mark.parametrize("rank", [0, 1])
def test_the_exit_path_ends_a_blocked_process_with_75(tmp_path, rank):
    started = time.monotonic()
    marks = tmp_path / "marks.jsonl"
    proc = subprocess.run([sys.executable, "-c", EXIT_PATH, str(tmp_path)], cwd=ROOT,
                          env={**env(), "RANK": str(rank), LAUNCH_MARKS_ENV: str(marks)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 75, proc.stderr[-2000:]
    [mark] = read_launch_marks(marks)  # what tells `posttrain launch` this 75 was a stall
    assert (mark["kind"], mark["rank"], mark["step"]) == ("stalled", rank, 3) and mark["idle_s"] >= 0.5
    assert "not reached" not in proc.stdout
    assert time.monotonic() - started < 30  # an interpreter start and 0.5 s, not the 60 s sleep
    assert "Current thread" in proc.stderr or "Thread 0x" in proc.stderr  # faulthandler's dump
    assert "wait_in_a_hung_collective" in proc.stderr
    own, other = ("alerts.jsonl", "alerts-rank1.jsonl") if rank == 0 else ("alerts-rank1.jsonl", "alerts.jsonl")
    [alert] = read_jsonl(tmp_path / own)
    assert not (tmp_path / other).exists()
    assert (alert["kind"], alert["rank"], alert["step"]) == ("stalled", rank, 3)
    [(name, stack)] = alert["stacks"].items()  # the main thread only: the watchdog's threads are left out
    assert name.startswith("MainThread") and "wait_in_a_hung_collective" in stack
    assert f"rank {rank}: no progress" in proc.stderr


def test_drills_target_one_rank_and_the_first_attempt_only(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert drill_step(4, None) == 4 and drill_step(4, 1) == 4 and drill_step(4, 0) is None
    assert drill_step(None, None) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert drill_step(4, None) == 4
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the group: no drill
    assert drill_step(4, None) is None and drill_step(4, 1) is None
    assert DebugConfig().crash_rank is None and DebugConfig().hang_rank is None


HANG = {"train.max_steps": 6, "train.save_every": 2, "train.keep_last": 3}


def timed_run(command: list[str], timeout: float = 180) -> tuple[subprocess.CompletedProcess, float, float]:
    """The finished process, its wall time and the clock (time.time) when it ended."""
    started = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - started, time.time()


@pytest.mark.slow
def test_hang_drill_on_one_process_exits_75_and_a_rerun_resumes(tiny_model_dir, sft_data, tmp_path, capsys):
    out = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, sft_data, out, **HANG)
    hung, wall, ended = timed_run(sft_command([*overrides, "debug.hang_at_step=2", "health.stall_timeout_s=3"]))
    assert hung.returncode == 75, hung.stderr[-3000:]
    assert wall < 90 and not (out / "final").exists()
    [stalled] = [a for a in read_jsonl(out / "alerts.jsonl") if a["kind"] == "stalled"]
    assert (stalled["rank"], stalled["step"], stalled["phase"]) == (0, 2, "step")
    assert 3 <= stalled["seconds_since_progress"] < 3 + 2
    assert "hang_forever" in stalled["stacks"][next(k for k in stalled["stacks"] if k.startswith("MainThread"))]
    assert "hang_forever" in hung.stderr and "no progress for" in hung.stderr
    hang_to_exit = stalled["seconds_since_progress"] + (ended - stalled["time"])

    rerun, _, _ = timed_run(sft_command(overrides))  # the same run without the drill: resumes from step 2
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert [a["step"] for a in read_jsonl(out / "alerts.jsonl") if a["kind"] == "resumed"] == [2]
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m] == list(range(6))
    assert final_weights(out)
    with capsys.disabled():
        print(f"\n[watchdog] 1 process, stall_timeout_s=3: hang to exit {hang_to_exit:.2f} s, first run {wall:.1f} s")


@pytest.mark.slow
def test_hang_on_one_of_two_ranks_ends_the_group_in_bounded_time(tiny_model_dir, sft_data, tmp_path, capsys):
    out = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, sft_data, out, **HANG, **{
        "train.batch_size": 2, "train.global_batch_size": 4, "debug.hang_at_step": 2, "debug.hang_rank": 1,
        "health.stall_timeout_s": 3})
    command = [sys.executable, "-m", "posttrain", "launch", "--standalone", "--nproc_per_node", "2", "--", "sft",
               *overrides]
    proc, wall, ended = timed_run(command)
    # 75 whatever the healthy rank died of (its watchdog, or a gloo error once the hung rank is gone): resumable
    assert proc.returncode == 75 and not (out / "final").exists(), proc.stderr[-3000:]
    assert "posttrain launch: stalled: no progress on rank" in proc.stderr
    assert wall < 120, proc.stderr[-3000:]
    stalled = [a for name in ("alerts.jsonl", "alerts-rank1.jsonl") for a in read_jsonl(out / name)
               if a["kind"] == "stalled"]
    assert stalled, proc.stderr[-3000:]  # at least one watchdog fired before the agent tore the group down
    assert all(a["step"] == 2 and a["phase"] == "step" for a in stalled)
    by_rank = {a["rank"]: a for a in stalled}
    if 1 in by_rank:  # the hung rank itself
        assert any("hang_forever" in stack for stack in by_rank[1]["stacks"].values())
    if 0 in by_rank:  # the healthy rank, waiting in the step's first collective (FSDP's all-gather) for the hung one
        name, main = next(iter(by_rank[0]["stacks"].items()))
        assert name.startswith("MainThread") and "torch/distributed" in main and "hang_forever" not in main
    first = min(stalled, key=lambda a: a["time"])
    with capsys.disabled():
        print(f"\n[watchdog] 2 ranks, rank 1 hangs, stall_timeout_s=3: exit code {proc.returncode}, watchdogs fired on "
              f"ranks {sorted(by_rank)}, hang to group exit {first['seconds_since_progress'] + ended - first['time']:.2f}"
              f" s, whole run {wall:.1f} s")
