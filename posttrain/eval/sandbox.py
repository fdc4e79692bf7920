"""Run untrusted Python (model-written code plus a task's unit tests) in a jail.

Each run gets: a separate process started in a new session; new network, mount, PID and IPC namespaces
(no network; the file system read-only except a fresh temporary working directory; home directories
hidden); an unprivileged uid no other process uses; limits on wall-clock time, CPU seconds, address space,
processes, file size and open files; an environment with nothing inherited but a fixed PATH and LANG
(HOME and TMPDIR point into the working directory). At the end every process the run started is killed:
the PID namespace dies with its first process, and a sweep kills anything left with the run's uid or session.

The jail is built by ``sandbox_launcher.py`` (see there for the exact steps). Where namespaces cannot be
created, :func:`sandbox_support` says why and code runs are refused unless the caller passes
``allow_unsandboxed=True`` (``eval.allow_unsandboxed_code``): then only the resource limits, the fresh
directory, the scrubbed environment and the process-group kill apply — no network or file-system isolation.
"""

from __future__ import annotations

import json
import os
import secrets
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

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
SETUP_ERROR_EXIT = 125
SETUP_ERROR_PREFIX = "posttrain-sandbox-setup:"
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
# First uid handed to sandboxed runs when posttrain runs as root; far above any uid a distribution assigns.
SANDBOX_UID_BASE = 1_500_000_000


class SandboxUnavailable(RuntimeError):
    """Code cannot be run safely here and the caller did not allow unsandboxed runs."""


class SandboxSetupError(RuntimeError):
    """Building the jail failed (an infrastructure problem, not the program's fault)."""


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_chars: int = 8000

    def spec(self) -> dict:
        return {
            "cpu_s": int(self.cpu_s),
            "memory_bytes": int(self.memory_mb) * 1024 * 1024,
            "max_processes": int(self.max_processes),
            "max_file_bytes": int(self.max_file_mb) * 1024 * 1024,
            "max_open_files": int(self.max_open_files),
        }


@dataclass
class SandboxResult:
    """``status``: ok | error (non-zero exit) | timeout (wall clock) | cpu_limit | memory | output_limit |
    blocked (the jail refused an operation: network, write outside the directory, too many processes) |
    killed (by another signal)."""

    status: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolated: bool
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)


_BLOCKED_MARKERS = (
    "Read-only file system",
    "Permission denied",
    "Network is unreachable",
    "Operation not permitted",
    "Resource temporarily unavailable",
    "BlockingIOError",
    "Cannot assign requested address",
    "Temporary failure in name resolution",
    "Name or service not known",
)


def _scrubbed_env(workdir: str) -> dict[str, str]:
    return {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _needed_prefixes() -> list[Path]:
    paths = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), Path(sys.executable).resolve().parent}
    return sorted(paths)


def _masks(run_dir: Path) -> list[dict]:
    """Directories to hide behind a tmpfs, each with the interpreter paths to mount back inside it.

    A directory is hidden when it is the user's home or when others cannot traverse it but the interpreter
    lives below it (e.g. /root/.pyenv: the sandbox uid could not even start Python otherwise).
    """
    hidden: dict[Path, set[Path]] = {}
    home = Path.home().resolve()
    if home != Path("/") and home.is_dir() and home not in run_dir.resolve().parents:
        hidden.setdefault(home, set())
    for prefix in _needed_prefixes():
        for ancestor in reversed(prefix.parents):
            if ancestor == Path("/"):
                continue
            if ancestor in hidden or not os.stat(ancestor).st_mode & 0o001:
                hidden.setdefault(ancestor, set())
                break
    for directory, keep in hidden.items():
        keep.update(p for p in _needed_prefixes() if directory in p.parents)
    # Never hide the run's own directory (e.g. TMPDIR inside the home directory).
    hidden = {d: k for d, k in hidden.items() if d not in run_dir.resolve().parents}
    outer = {d: k for d, k in hidden.items() if not any(o in d.parents for o in hidden)}
    masks = []
    for directory, keep in sorted(outer.items()):
        kept = sorted(k for k in keep if not any(o in k.parents for o in keep))
        masks.append({"dir": str(directory), "keep": [str(k) for k in kept]})
    return masks


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _allocate_uid() -> int:
    with _uid_lock:
        while True:
            uid = SANDBOX_UID_BASE + secrets.randbelow(100_000_000)
            if uid not in _uids_in_use and not _processes_of_uid(uid):
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


def _tail(path: Path, limit: int) -> str:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - limit * 4))
        text = handle.read().decode("utf-8", errors="replace")
    if len(text) > limit:
        return "…" + text[-limit:]
    return text if size <= limit * 4 else "…" + text


def _classify(exit_code, sig, timed_out, stderr: str) -> str:
    if timed_out:
        return "timeout"
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
    if sig is not None:
        return "killed"
    return "error"


def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    allow_unsandboxed: bool = False,
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh directory (plus optional extra ``files``) inside the jail.

    Raises SandboxUnavailable when namespaces cannot be created here and ``allow_unsandboxed`` is False,
    SandboxSetupError when the jail could not be built. A misbehaving program never raises: its fate is in
    ``SandboxResult.status``.
    """
    limits = limits or SandboxLimits()
    supported, reason = sandbox_support()
    if not supported and not allow_unsandboxed:
        raise SandboxUnavailable(
            f"cannot isolate code here ({reason}); refusing to run model-written code. Set "
            "eval.allow_unsandboxed_code=true (CLI: --allow-unsandboxed-code) only on a machine you can afford to lose."
        )
    return _run(code, limits, "namespaces" if supported else "rlimits", files or {})


def _run(code: str, limits: SandboxLimits, mode: str, files: dict[str, str]) -> SandboxResult:
    run_dir = Path(tempfile.mkdtemp(prefix="posttrain-sandbox-"))
    os.chmod(run_dir, 0o711)  # the sandbox uid may pass through to its directory, but not list or read the rest
    workdir = run_dir / "work"
    workdir.mkdir()
    (run_dir / "stage").mkdir()
    as_root = os.geteuid() == 0
    uid = _allocate_uid() if as_root and mode == "namespaces" else None
    started = time.monotonic()
    notes: list[str] = []
    try:
        for name, content in {**files, "main.py": code}.items():
            target = (workdir / name).resolve()
            if workdir.resolve() not in target.parents:
                raise ValueError(f"sandbox file name {name!r} escapes the working directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")
        if uid is not None:
            for path in [workdir, *workdir.rglob("*")]:
                os.chown(path, uid, uid)
        os.chmod(workdir, 0o700)
        spec = {
            "mode": mode,
            "workdir": str(workdir),
            "stage_dir": str(run_dir / "stage"),
            "status_path": str(run_dir / "status.json"),
            "python": sys.executable,
            "script": "main.py",
            "uid": uid,
            "gid": uid,
            "limits": limits.spec(),
            "masks": _masks(run_dir) if mode == "namespaces" else [],
            "env": _scrubbed_env(str(workdir)),
        }
        _write_private(run_dir / "spec.json", json.dumps(spec).encode())
        stdout_path, stderr_path = run_dir / "stdout", run_dir / "stderr"
        _write_private(stdout_path, b"")
        _write_private(stderr_path, b"")
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", str(LAUNCHER), str(run_dir / "spec.json")],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=str(workdir),
                env=_scrubbed_env(str(workdir)),
                start_new_session=True,
            )
            timed_out = False
            try:
                process.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _stop(process, mode)
        # Leftovers: the PID namespace normally takes everything down with its first process; this sweep is
        # the double check (and the only cleanup in rlimits mode).
        notes += _kill_all(_processes_of_uid, uid) if uid is not None else []
        notes += _kill_all(_processes_of_session, process.pid)
        duration = time.monotonic() - started
        stdout = _tail(stdout_path, limits.max_output_chars)
        stderr = _tail(stderr_path, limits.max_output_chars)
        if process.returncode == SETUP_ERROR_EXIT and SETUP_ERROR_PREFIX in stderr:
            raise SandboxSetupError(stderr.strip())
        exit_code, sig = _exit_status(process.returncode, run_dir / "status.json", mode)
        if mode == "namespaces" and exit_code == SETUP_ERROR_EXIT and SETUP_ERROR_PREFIX in stderr:
            raise SandboxSetupError(stderr.strip())
        status = _classify(exit_code, sig, timed_out, stderr)
        return SandboxResult(status, exit_code, sig, stdout, stderr, duration, mode == "namespaces", notes)
    finally:
        if uid is not None:
            _release_uid(uid)
        shutil.rmtree(run_dir, ignore_errors=True)


def _stop(process: subprocess.Popen, mode: str) -> None:
    """End a run that overstayed. In namespaces mode ask the launcher first: it kills the namespace's first
    process (taking the whole namespace down) and reaps it, so nothing is left as an orphan zombie."""
    if mode == "namespaces":
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _exit_status(returncode: int | None, status_path: Path, mode: str) -> tuple[int | None, int | None]:
    if mode == "namespaces":
        try:
            record = json.loads(status_path.read_text())
            return record["exit_code"], record["signal"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return None, signal.SIGKILL  # the launcher itself was killed (wall-clock timeout)
    if returncode is None:
        return None, None
    return (None, -returncode) if returncode < 0 else (returncode, None)


@lru_cache(maxsize=1)
def sandbox_support() -> tuple[bool, str]:
    """Whether full isolation works on this machine (probed once per process), and why not if it does not."""
    if sys.platform != "linux":
        return False, f"namespaces need Linux (this is {sys.platform})"
    probe = "import socket, os\nprint('sandbox-ok', os.getuid() != 0)\n"
    try:
        result = _run(probe, SandboxLimits(timeout_s=30, cpu_s=10), "namespaces", {})
    except (SandboxSetupError, OSError) as exc:
        return False, f"could not create namespaces: {str(exc).splitlines()[-1] if str(exc) else exc!r}"
    if result.stdout.strip() != "sandbox-ok True":
        return False, f"probe failed ({result.status}): {result.stderr.strip()[-300:]}"
    return True, "network, mount, PID and IPC namespaces; unprivileged uid; read-only file system"
