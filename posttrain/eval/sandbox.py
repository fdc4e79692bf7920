"""Run untrusted Python in a jail: a program (:func:`run_python`), or a code item's solution and its tests
(:func:`run_tests`, what the ``code`` verifier uses).

The jail is bubblewrap (``sandbox_jail.py`` says why, and what it holds): new network (only the jail's own
loopback), PID, IPC, UTS and cgroup namespaces; an empty root with only the interpreter, its standard
library and its shared libraries, read-only; a private /work (work dir, HOME, and /tmp through a symlink)
on a tmpfs of ``disk_mb``; a seccomp filter that refuses new namespaces, mounts, ptrace and other kernel
surface; as root, a fresh uid no other process uses. Inside, ``sandbox_runner.py`` sets resource limits
(CPU seconds, address space, processes, file size, open files, no core dumps) and runs the code. Everything
it started dies with the jail's PID namespace (after a kill on timeout, a sweep by uid double-checks).

A code item is judged by a **test process** that never shares memory with the **solution process** (see
``sandbox_runner.py`` and ``sandbox_wire.py``): the tests call the solution through a pipe pair and values
cross as data, so exiting early, hooking the exit, monkeypatching the runner or the builtins, or writing a
fake "passed" anywhere cannot pass an item. Only the test process writes the verdict, with a per-run
nonce, on a descriptor only it holds; ``status == "ok"`` means the tests ran to their end.

Without bubblewrap (or user namespaces, for a non-root user), :func:`sandbox_support` says why, and code is
refused unless the caller passes ``allow_unsandboxed=True`` (``eval.allow_unsandboxed_code``): then only
the resource limits, a fresh directory, the scrubbed environment and the two processes apply.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from posttrain.eval.sandbox_jail import (
    RUNNER_DIR,
    TMPDIR,
    WORKDIR,
    bwrap_command,
    jail_layout,
    runner_command,
    runner_dir,
    seccomp_program,
    seccomp_supported,
)

SETUP_ERROR_EXIT = 125
SETUP_ERROR_PREFIX = "posttrain-sandbox-setup:"
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
# First uid handed to sandboxed runs when posttrain runs as root; far above any uid a distribution assigns.
SANDBOX_UID_BASE = 1_500_000_000
MB = 1024 * 1024


class SandboxUnavailable(RuntimeError):
    """Code cannot be run safely here and the caller did not allow unsandboxed runs."""


class SandboxSetupError(RuntimeError):
    """Building the jail failed (an infrastructure problem, not the program's fault)."""


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0
    cpu_s: int = 10  # per process
    memory_mb: int = 1024  # address space, per process
    max_processes: int = 32
    max_file_mb: int = 16  # per file; also caps stdout and stderr
    max_open_files: int = 64
    max_output_chars: int = 8000  # of stdout/stderr kept in the result
    disk_mb: int = 64  # everything written under /work and /tmp together (a tmpfs: it is memory)

    def spec(self) -> dict:
        return {
            "cpu_s": int(self.cpu_s),
            "memory_bytes": int(self.memory_mb) * MB,
            "max_processes": int(self.max_processes),
            "max_file_bytes": int(self.max_file_mb) * MB,
            "max_open_files": int(self.max_open_files),
        }


@dataclass
class SandboxResult:
    """``status``: ok (a program exited 0; a code item's tests ran to their end and held) | error (non-zero
    exit; a test failed) | timeout (wall clock) | cpu_limit | memory | output_limit | blocked (the jail
    refused an operation: network, a write outside /work, too many processes) | killed (another signal).
    ``failure`` says why a code item's tests did not pass, as the test process saw it."""

    status: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolated: bool
    notes: list[str] = field(default_factory=list)
    failure: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)


_BLOCKED_MARKERS = (
    "Read-only file system",
    "Permission denied",
    "Network is unreachable",
    "Connection refused",  # the jail's own loopback has nothing listening but what the code itself opened
    "Operation not permitted",
    "Resource temporarily unavailable",
    "BlockingIOError",
    "Cannot assign requested address",
    "Temporary failure in name resolution",
    "Name or service not known",
)


def printable_excerpt(text: str, limit: int = 240) -> str:
    """``text`` safe to show anywhere: control characters (ANSI escapes, BEL, NUL, C1), undecodable bytes
    and other non-printable characters become ``\\x..``/``\\u..`` escapes; at most ``limit`` characters."""
    pieces, size = [], 0
    for char in text:
        piece = char if char.isprintable() else _escape(char)
        if size + len(piece) > limit:
            pieces.append("…")
            break
        pieces.append(piece)
        size += len(piece)
    return "".join(pieces)


def _escape(char: str) -> str:
    code = ord(char)
    if char in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[char]
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte kept by surrogateescape
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _allocate_uid() -> int:
    """A uid for one run. Unique within this process; two posttrain processes drawing the same one of 10^8
    would only share a process count (their jails cannot see each other)."""
    with _uid_lock:
        while True:
            uid = SANDBOX_UID_BASE + secrets.randbelow(100_000_000)
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def _proc_entries():
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def _processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real uid is ``uid``."""
    found = []
    for pid in _proc_entries():
        try:
            with open(f"/proc/{pid}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                found.append(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError, KeyError, ValueError):
            continue
    return found


def _processes_of_session(session: int) -> list[int]:
    found = []
    for pid in _proc_entries():
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            # fields[0] is the state (field 3 of stat), fields[3] the session id (field 6)
            if fields[0] != "Z" and int(fields[3]) == session and pid != os.getpid():
                found.append(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, ValueError):
            continue
    return found


def _kill_all(find, key: int, deadline_s: float = 5.0) -> list[str]:
    """SIGKILL every process ``find(key)`` reports until none is left (a fork bomb may still be forking)."""
    notes = []
    end = time.monotonic() + deadline_s
    killed = 0
    while True:
        pids = find(key)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > end:
            notes.append(f"{len(pids)} processes still alive after the sweep")
            break
        time.sleep(0.02)
    if killed:
        notes.append(f"killed {killed} leftover processes")
    return notes


def _require_isolation(allow_unsandboxed: bool) -> bool:
    supported, reason = sandbox_support()
    if not supported and not allow_unsandboxed:
        raise SandboxUnavailable(
            f"cannot isolate code here ({reason}); refusing to run model-written code. Set "
            "eval.allow_unsandboxed_code=true (CLI: --allow-unsandboxed-code) only on a machine you can afford to lose."
        )
    return supported


def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    allow_unsandboxed: bool = False,
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in the work dir (plus optional extra ``files``) inside the jail.

    Raises SandboxUnavailable when the jail cannot be built here and ``allow_unsandboxed`` is False,
    SandboxSetupError when building it failed. A misbehaving program never raises: its fate is in
    ``SandboxResult.status``.
    """
    isolated = _require_isolation(allow_unsandboxed)
    return _run({"mode": "program", "files": {**(files or {}), "main.py": code}}, limits or SandboxLimits(), isolated)


def run_tests(
    solution: str,
    tests: str,
    limits: SandboxLimits | None = None,
    allow_unsandboxed: bool = False,
) -> SandboxResult:
    """Run ``solution`` (as ``main.py``) and ``tests`` against it in the jail, in two processes; ``status``
    is ok only when the tests ran to their end with every assertion holding, and, where they define
    ``unittest.TestCase`` classes or call ``unittest.main``, every test of those ran and passed (none skipped);
    ``failure`` says why not. The solution can read neither the tests nor the verdict. Raises as
    :func:`run_python`."""
    isolated = _require_isolation(allow_unsandboxed)
    job = {"mode": "tests", "files": {"main.py": solution}, "tests": tests}
    return _run(job, limits or SandboxLimits(), isolated)


def _run(job: dict, limits: SandboxLimits, isolated: bool) -> SandboxResult:
    layout = jail_layout()
    uid = _allocate_uid() if isolated and os.geteuid() == 0 else None
    host_dir = None if isolated else Path(tempfile.mkdtemp(prefix="posttrain-sandbox-"))
    workdir = WORKDIR if isolated else str(host_dir)
    tmpdir = TMPDIR if isolated else str(host_dir / ".tmp")
    nonce = secrets.token_hex(16)
    spec = {**job, "nonce": nonce, "uid": uid, "workdir": workdir, "tmpdir": tmpdir, "limits": limits.spec(),
            "env": {"PATH": os.path.dirname(layout.python), "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": tmpdir}}
    opened: list[int] = []
    started = time.monotonic()
    try:
        spec_fd = _memfd("spec", json.dumps(spec).encode(), opened)
        status_fd = _memfd("status", b"", opened)
        stdout_fd, stdout_writer = _output(opened)
        stderr_fd, stderr_writer = _output(opened)
        runner = runner_command(layout.python, RUNNER_DIR if isolated else runner_dir())
        command = [*runner, "supervise", str(spec_fd), str(status_fd)]
        child_only = [stdout_writer, stderr_writer]
        info_fd = None
        if isolated:
            seccomp_fd = _pipe_holding(seccomp_program(), opened)
            info_fd, info_writer = os.pipe()
            opened += [info_fd, info_writer]
            child_only += [seccomp_fd, info_writer]
            command = bwrap_command(_bwrap(), layout, limits.disk_mb * MB, uid is not None, seccomp_fd,
                                    info_writer) + command
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=stdout_writer, stderr=stderr_writer,
            pass_fds=[spec_fd, status_fd, *child_only[2:]], cwd=workdir if host_dir else "/",
            env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"}, start_new_session=True,
        )
        for fd in child_only:
            os.close(fd)
            opened.remove(fd)
        timed_out = not _wait(process, limits.timeout_s)
        # bubblewrap exits only after the jail's PID 1, and the kernel kills every process of a PID namespace
        # before its PID 1 is gone: a finished jail has no leftovers. Sweep where that does not hold: after a
        # kill on timeout (by uid, when root) and without the jail (by session).
        killed_jail = _stop(process, info_fd) if timed_out else True
        notes = _kill_all(_processes_of_uid, uid) if uid is not None and not killed_jail else []
        if not isolated or not killed_jail:
            notes += _kill_all(_processes_of_session, process.pid)
        duration = time.monotonic() - started
        records = _records(status_fd)
        stdout = _tail(stdout_fd, limits.max_output_chars)
        stderr = _tail(stderr_fd, limits.max_output_chars)
        if not any(record.get("ready") for record in records) and not timed_out:
            raise SandboxSetupError(stderr.strip() or f"the jail exited with {process.returncode} before it was ready")
        final = records[-1] if records and not records[-1].get("ready") else None
        if job["mode"] == "tests":
            return _judged(final, nonce, records, timed_out, process.returncode, stdout, stderr, duration,
                           isolated, notes)
        exit_code, sig = (final.get("exit_code"), final.get("signal")) if final else _runner_status(process.returncode)
        status = "timeout" if timed_out else _classify(exit_code, sig, stderr)
        return SandboxResult(status, exit_code, sig, stdout, stderr, duration, isolated, notes)
    finally:
        for fd in opened:
            os.close(fd)
        if uid is not None:
            _release_uid(uid)
        if host_dir is not None:
            shutil.rmtree(host_dir, ignore_errors=True)


def _judged(final, nonce, records, timed_out, returncode, stdout, stderr, duration, isolated, notes) -> SandboxResult:
    """The result of a tests run, from the test process's verdict only: the verdict must carry this run's
    nonce and be the one record after ``ready`` (anything else is not the runner's doing)."""
    authentic = final is not None and final.get("nonce") == nonce and len(records) == 2
    if timed_out or not authentic:
        exit_code, sig = _runner_status(returncode)
        if timed_out:
            status, failure = "timeout", ""
        elif final is None:  # the test process died (its own limits): never a pass
            status = _classify(exit_code, sig, "")
            status, failure = ("error", "the test process ended without a verdict") if status == "ok" else (status, "")
        else:
            status, failure = "error", "the verdict did not come from this run's test process"
        return SandboxResult(status, None, sig, stdout, stderr, duration, isolated, notes, failure)
    failure = str(final.get("failure", ""))
    sig = final.get("solution_signal")
    if final.get("passed") is True:
        status = "ok"
    elif sig == signal.SIGXCPU:
        status = "cpu_limit"
    elif sig == signal.SIGXFSZ:
        status = "output_limit"
    elif final.get("failure_type") == "MemoryError":
        status = "memory"
    elif any(marker in failure for marker in _BLOCKED_MARKERS):
        status = "blocked"
    else:
        status = "killed" if sig is not None else "error"
    return SandboxResult(status, None, sig, stdout, stderr, duration, isolated, notes, failure)


def _classify(exit_code, sig, stderr: str) -> str:
    if sig == signal.SIGXCPU:
        return "cpu_limit"
    if sig == signal.SIGXFSZ:
        return "output_limit"
    tail = stderr[-2000:]
    if "MemoryError" in tail or "Cannot allocate memory" in tail or "std::bad_alloc" in tail:
        return "memory"
    if exit_code == 0 and sig is None:
        return "ok"
    if any(marker in tail for marker in _BLOCKED_MARKERS):
        return "blocked"
    return "killed" if sig is not None else "error"


def _runner_status(returncode: int | None) -> tuple[int | None, int | None]:
    """The runner's own fate, from bubblewrap's exit code (128 + signal for a signal) or Popen's."""
    if returncode is None:
        return None, None
    if returncode < 0:
        return None, -returncode
    return (None, returncode - 128) if returncode > 128 else (returncode, None)


def _wait(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the process to end, at most ``timeout_s``; False on timeout. A pidfd wakes us the moment it
    exits (``Popen.wait(timeout)`` polls with sleeps of up to 50 ms, a large share of a short run)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        try:
            process.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout_s))
    finally:
        os.close(pidfd)
    if ready:
        process.wait()
    return bool(ready)


def _stop(process: subprocess.Popen, info_fd: int | None) -> bool:
    """End a run that overstayed. Kill the jail's first process (its PID 1, which bubblewrap reported on
    the info pipe): the kernel then kills everything in the namespace and bubblewrap exits. True when that
    worked; otherwise the process group is killed and the caller sweeps."""
    child_pid = None
    if info_fd is not None:
        os.set_blocking(info_fd, False)
        try:
            child_pid = json.loads(os.read(info_fd, 65536) or b"{}").get("child-pid")
        except (OSError, ValueError):
            child_pid = None
    if isinstance(child_pid, int) and child_pid > 1 and _parent_of(child_pid) == process.pid:
        try:
            os.kill(child_pid, signal.SIGKILL)
            process.wait(timeout=5)
            return True
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    return False


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _memfd(name: str, data: bytes, opened: list[int]) -> int:
    fd = os.memfd_create(f"posttrain-sandbox-{name}")
    opened.append(fd)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _output(opened: list[int]) -> tuple[int, int]:
    """A memory file for stdout or stderr, and a write-only, append-only descriptor of it for the jail:
    the code can write its output but neither read it back nor overwrite what came before."""
    fd = _memfd("output", b"", opened)
    writer = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    opened.append(writer)
    return fd, writer


def _pipe_holding(data: bytes, opened: list[int]) -> int:
    reader, writer = os.pipe()
    opened.append(reader)
    try:
        os.write(writer, data)  # far below a pipe's buffer
    finally:
        os.close(writer)
    return reader


def _records(status_fd: int) -> list[dict]:
    os.lseek(status_fd, 0, os.SEEK_SET)
    raw = os.read(status_fd, 1 << 20)
    records = []
    for line in raw.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = {"unreadable": True}
        records.append(record if isinstance(record, dict) else {"unreadable": True})
    return records


def _tail(fd: int, limit: int) -> str:
    size = os.fstat(fd).st_size
    start = max(0, size - limit * 4)
    text = os.pread(fd, size - start, start).decode("utf-8", errors="backslashreplace")
    if len(text) > limit:
        return "…" + text[-limit:]
    return text if start == 0 else "…" + text


def _bwrap() -> str | None:
    return shutil.which("bwrap", path=SAFE_PATH)


@lru_cache(maxsize=1)
def sandbox_support() -> tuple[bool, str]:
    """Whether the jail works on this machine (probed once per process), and why not if it does not."""
    if sys.platform != "linux":
        return False, f"the sandbox needs Linux (this is {sys.platform})"
    if not seccomp_supported():
        return False, f"no seccomp filter for this CPU architecture ({platform.machine()})"
    if _bwrap() is None:
        return False, "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    probe = "import os\nprint('sandbox-ok', os.getuid() != 0)\n"
    try:
        result = _run({"mode": "program", "files": {"main.py": probe}}, SandboxLimits(timeout_s=30, cpu_s=10), True)
    except (SandboxSetupError, OSError, RuntimeError, subprocess.SubprocessError) as exc:
        lines = str(exc).strip().splitlines()
        return False, f"bubblewrap could not build the jail: {lines[-1] if lines else repr(exc)}"
    if result.stdout.strip() != "sandbox-ok True":
        return False, f"probe failed ({result.status}): {result.stderr.strip()[-300:]}"
    who = "a fresh uid" if os.geteuid() == 0 else "a user namespace"
    return True, (f"bubblewrap: no network, empty root with the interpreter read-only, PID/IPC/UTS/cgroup "
                  f"namespaces, seccomp, {who}")
