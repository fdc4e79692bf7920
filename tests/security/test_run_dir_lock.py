"""One training run per output_dir (``posttrain.store.lock``), and a read-only output_dir is exit 2.

The refused or failing run is always a real ``python -m posttrain sft`` process; the run that holds the
directory is this test process (or a child it kills), through the same lock module the CLI uses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.store import RunStore
from posttrain.store.lock import LEASE, LOCK_FILE, lock_run
from tests.train.conftest import ROOT, base_overrides, env, make_sft_jsonl, sft_command

SHORT = {"train.max_steps": 2, "train.save_every": 100}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> str:
    return str(make_sft_jsonl(tmp_path_factory.mktemp("sftdata") / "train.jsonl", n=16))


def run_cli(overrides: list[str], prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    environment = env()
    environment.pop("TORCHELASTIC_RUN_ID", None)
    return subprocess.run([*prefix, *sft_command(overrides)], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=300)


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("posttrain:")]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def start_holder(code: str, *args: str) -> subprocess.Popen:
    """A child process that takes a lock (``code``), says ``held`` and sleeps until killed."""
    script = f"import sys, time\nfrom posttrain.store import RunStore\nfrom posttrain.store.lock import lock_run\n" \
             f"{code}\nprint('held', flush=True)\ntime.sleep(600)\n"
    holder = subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


# -- a local output_dir ------------------------------------------------------------------------------------

def test_a_second_run_in_a_held_output_dir_exits_2_naming_the_first(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    with lock_run(RunStore(str(out))):  # this test process is the first run
        refused = run_cli(base_overrides(tiny_model_dir, sft_data, out, **SHORT))
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = error_line(refused)
    assert line.startswith(f"posttrain: output_dir {out} is in use by another run (pid {os.getpid()} on host "
                           f"{socket.gethostname()}, started "), line
    assert line.endswith("wait for it or use another output_dir"), line
    assert not (out / "config.yaml").exists()  # refused before any run state was written


def test_a_lock_left_by_a_killed_run_does_not_block(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "run"
    holder = start_holder("lock_run(RunStore(sys.argv[1]))", str(out))
    holder.kill()  # SIGKILL: no clean-up ran; the kernel dropped the flock, the file stays
    holder.wait()
    holder.stdout.close()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == holder.pid
    result = run_cli(base_overrides(tiny_model_dir, sft_data, out, **SHORT))
    assert result.returncode == 0, result.stderr[-3000:]
    last = json.loads((out / LOCK_FILE).read_text())  # the lock file now describes the run that took it
    assert last["pid"] not in (holder.pid, os.getpid()) and last["host"] == socket.gethostname()
    assert " sft" in last["command"] and "=" not in last["command"]  # overrides (secrets, maybe) are not recorded
    with lock_run(RunStore(str(out))):  # and the finished run let go of it
        pass


# -- a remote output_dir: the lease ------------------------------------------------------------------------

def test_a_live_s3_lease_blocks_a_run_and_its_release_removes_it(tiny_model_dir, sft_data, s3_bucket, tmp_path):
    url = f"{s3_bucket}/run"
    holder = lock_run(RunStore(url, tmp_path / "holder-mirror"), ttl_s=1.5)  # renewed every 0.5 s
    try:
        lease = json.loads(RunStore(url).read_bytes(LEASE))
        assert lease["pid"] == os.getpid() and lease["ttl_s"] == 1.5
        refused = run_cli(base_overrides(tiny_model_dir, sft_data, url, **SHORT,
                                         **{"store.local_dir": tmp_path / "mirror"}))
        assert json.loads(RunStore(url).read_bytes(LEASE))["renewed"] > lease["renewed"]  # kept alive meanwhile
    finally:
        holder.release()
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = error_line(refused)
    assert f"output_dir {url} is in use by another run (pid {os.getpid()} on host {socket.gethostname()}" in line
    assert f"its lease {url}/{LEASE} was renewed within its 1.5 s ttl" in line, line
    store = RunStore(url)
    assert store.read_bytes(LEASE) is None  # removed at the holder's release
    assert store.read_bytes("config.yaml") is None  # the refused run wrote nothing


def test_an_expired_s3_lease_is_taken_over_and_removed_at_the_end(tiny_model_dir, sft_data, s3_bucket, tmp_path):
    url = f"{s3_bucket}/run"
    crashed = {"owner": "crashed-run", "host": "node-7", "pid": 4242, "started": "2024-01-01T00:00:00Z",
               "renewed": time.time(), "ttl_s": 1.0, "run_id": None, "namespace": None}
    RunStore(url).write_bytes(LEASE, json.dumps(crashed).encode())  # another node's run, crashed a moment ago
    result = run_cli(base_overrides(tiny_model_dir, sft_data, url, **SHORT, **{"store.local_dir": tmp_path / "m"}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"took over the lease {url}/{LEASE} of pid 4242 on host node-7, started 2024-01-01T00:00:00Z: it was "
            "not renewed for 1 s") in result.stderr, result.stderr[-3000:]
    store = RunStore(url)
    assert store.read_bytes("finished.json") is not None
    assert store.read_bytes(LEASE) is None  # the run ended cleanly: its lease is gone


def test_the_same_torchrun_job_takes_its_lease_over_at_once(s3_bucket, tmp_path, monkeypatch):
    url = f"{s3_bucket}/run"
    live = {"owner": "previous-attempt", "host": "node-1", "pid": 1, "started": "2024-01-01T00:00:00Z",
            "renewed": time.time(), "ttl_s": 30.0, "run_id": "job-7", "namespace": None}
    RunStore(url).write_bytes(LEASE, json.dumps(live).encode())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")  # an elastic restart of the same job
    started = time.monotonic()
    lock = lock_run(RunStore(url, tmp_path / "m"), ttl_s=30)
    try:
        assert time.monotonic() - started < 10  # not the 30 s ttl
        assert lock.notes == [f"took over the lease {url}/{LEASE} of pid 1 on host node-1, started "
                              "2024-01-01T00:00:00Z: it belongs to this torchrun job (job-7), restarted"]
        assert json.loads(RunStore(url).read_bytes(LEASE))["owner"] == lock.lease.owner
    finally:
        lock.release()
    assert RunStore(url).read_bytes(LEASE) is None


def test_a_lease_renewed_long_ago_is_taken_over_without_waiting_out_its_ttl(s3_bucket, tmp_path):
    url = f"{s3_bucket}/run"
    old = {"owner": "gone", "host": "node-2", "pid": 2, "started": "2024-01-01T00:00:00Z",
           "renewed": time.time() - 3600, "ttl_s": 30.0, "run_id": None, "namespace": None}
    RunStore(url).write_bytes(LEASE, json.dumps(old).encode())
    started = time.monotonic()
    with lock_run(RunStore(url, tmp_path / "m"), ttl_s=30) as lock:
        assert time.monotonic() - started < 10
        assert re.search(r"it was last renewed 36\d\d s ago$", lock.notes[0]), lock.notes
    assert RunStore(url).read_bytes(LEASE) is None  # leaving the block released it


def test_a_killed_holder_on_this_machine_is_taken_over_at_once_and_another_job_waits(s3_bucket, tmp_path,
                                                                                      monkeypatch):
    url = f"{s3_bucket}/run"
    holder = start_holder("lock_run(RunStore(sys.argv[1], sys.argv[2]), ttl_s=30)", url, str(tmp_path / "h"))
    holder.kill()  # its lease stays in the store, renewed a moment ago, with a 30 s ttl
    holder.wait()
    holder.stdout.close()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")
    started = time.monotonic()
    lock = lock_run(RunStore(url, tmp_path / "m"), ttl_s=30)
    try:
        assert time.monotonic() - started < 10
        assert lock.notes[0].endswith(f"its process {holder.pid} on this machine is gone"), lock.notes
    finally:
        lock.release()


# -- an output_dir that cannot be written ------------------------------------------------------------------

@pytest.fixture
def read_only(tmp_path) -> tuple[Path, tuple[str, ...]]:
    """A directory, and the command prefix that runs a process with it bind-mounted read-only (EROFS even for
    root, unlike chmod) in its own user and mount namespaces."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare for a read-only bind mount")
    directory = tmp_path / "ro"
    (directory / "run").mkdir(parents=True)
    prefix = ("unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(directory))
    probe = subprocess.run([*prefix, "touch", str(directory / "probe")], capture_output=True, text=True)
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"user and mount namespaces are not available here (unshare -rm): {probe.stderr.strip()}")
    return directory, prefix


@pytest.mark.parametrize("where", ["run", "new/run"])  # an existing run directory; one to be created
def test_a_read_only_output_dir_is_exit_2_naming_it(tiny_model_dir, sft_data, read_only, where):
    directory, prefix = read_only
    out = directory / where
    result = run_cli(base_overrides(tiny_model_dir, sft_data, out, **SHORT), prefix)
    assert result.returncode == 2, result.stderr[-3000:]
    line = error_line(result)
    assert line.startswith(f"posttrain: output_dir {out} is not writable (Read-only file system"), line
    assert line.endswith("choose a writable directory"), line
