"""One training run per ``output_dir``: a lock the main process holds for the whole run.

Two runs writing into one directory corrupt each other's checkpoints and logs, so ``start_run`` (rank 0) takes
``lock_run(store)`` before it reads or writes any run state; a second run exits 2 naming the first.

**Local directory** (``output_dir`` itself, or the local mirror of a remote one): ``fcntl.flock`` on a lock file.
The kernel drops the lock when the process dies, however it dies, so a restart after a crash, a SIGKILL or an
exit 75 takes it at once; a lock file left behind by a dead process blocks nothing. The file holds the holder's
description (host, pid, start time, command), which the refused run prints. It is never removed nor replaced
by a rename: a run that opened the old inode and one that created a new file would both "hold" the lock.
A remote run's mirror is locked through a file *beside* the mirror (``.<name>.posttrain.lock``): the mirror
itself is deleted and re-created by ``train.resume=never``.

**Remote store** (``s3://…``): the store has no locks, so the run holds a *lease*, the object
``<prefix>/.posttrain-lease.json`` = ``{owner, host, pid, started, renewed, ttl_s, …}``, rewritten by a daemon
thread every ``ttl_s / 3`` and removed when the run ends cleanly. A start that finds another owner's lease:

- takes it over at once when it belongs to the same torchrun job (``TORCHELASTIC_RUN_ID``: an elastic
  restart), when its process is dead on this very machine (same boot and pid namespace), or when it was last
  renewed more than ``STALE_AFTER`` ttls and a minute ago by the wall clock (a run that crashed long ago);
- otherwise watches it, timing with its own clock (no trust in the other host's): renewed within its
  ``ttl_s`` means the other run is alive and this one exits 2 naming it; not renewed for ``ttl_s`` means its
  run crashed, and the lease is taken over.

Taking a lease is write, wait a moment, read back: of two runs that write at the same time the one whose
record is not there loses (exit 2). This is a best-effort lease, not consensus: the store offers no
compare-and-swap through ``RunStore``, so two writes racing within the settle delay, or a holder stalled
for longer than its ttl (its renewals late), can still leave two runs believing they hold it. A holder that
finds its lease taken says so on stderr. It guards against the usual mistake — the same command started
twice, a second job pointed at a running one's prefix — not against an adversary.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from posttrain.store.run_store import RunStore

LOCK_FILE = ".posttrain.lock"
LEASE = ".posttrain-lease.json"
LEASE_TTL_S = 60.0  # a renewal every 20 s; a crashed run's lease blocks a new start for at most a minute
# A lease last renewed, by the wall clock, more than STALE_AFTER ttls + CLOCK_SKEW_S ago is dead without waiting;
# the margin keeps two hosts' clocks that disagree by up to a minute from taking a live lease.
STALE_AFTER = 5
CLOCK_SKEW_S = 60.0
# What a directory that cannot be written fails with; the run's message names the path and the problem.
NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST})


class RunDirError(RuntimeError):
    """``output_dir`` cannot be used: another run holds it, or it cannot be written (exit 2)."""


def _command() -> str:
    """The command line, without its ``key=value`` overrides: they can carry secrets (a webhook URL's token),
    and the lease lives in a bucket that other people may read."""
    words = [Path(sys.argv[0]).name if sys.argv else "python"]
    words += [word for word in sys.argv[1:] if "=" not in word]
    return " ".join(words)[:300]


def _process_namespace() -> str | None:
    """This machine's boot and this process's pid namespace: a pid means the same process only within both
    (containers on one host often share its hostname). None where Linux's /proc is not there."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def describe_holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": _command(),
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID") or None, "namespace": _process_namespace()}


def _who(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"
    return who + (f": {holder['command']}" if holder.get("command") else "")


def in_use(where: str, holder: dict[str, Any], detail: str = "") -> RunDirError:
    return RunDirError(f"output_dir {where} is in use by another run ({_who(holder)}{detail}); wait for it or use "
                       "another output_dir")


def not_writable(where: str, exc: OSError) -> RunDirError:
    if exc.errno == errno.EEXIST:  # mkdir(exist_ok=True) on a file
        return RunDirError(f"output_dir {where} is a file, not a directory: choose another output_dir")
    problem = exc.strerror or type(exc).__name__
    if exc.filename and str(exc.filename) != where:
        problem += f": {exc.filename}"
    return RunDirError(f"output_dir {where} is not writable ({problem}): choose a writable directory")


class FileLock:
    """An exclusive ``flock`` on ``path``, held until ``release`` or the process's end."""

    def __init__(self, path: Path, where: str):
        self.path, self.where = path, where  # ``where``: the output_dir the messages name
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = json.loads(os.read(fd, 65536) or b"{}")
                except ValueError:  # the holder is between taking the lock and writing its description
                    holder = {}
                raise in_use(self.where, holder if isinstance(holder, dict) else {}) from None
            os.ftruncate(fd, 0)  # in place, never a new file (see the module docstring)
            os.pwrite(fd, json.dumps(describe_holder()).encode() + b"\n", 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the description stays: it says who held the directory last; the lock goes
            self.fd = None


class StoreLease:
    """The lease object ``LEASE`` in a remote run store (see the module docstring)."""

    def __init__(self, store: RunStore, ttl_s: float = LEASE_TTL_S, settle_s: float | None = None):
        self.store, self.ttl_s = store, ttl_s
        self.settle_s = min(1.0, ttl_s / 10) if settle_s is None else settle_s
        self.poll_s = max(0.1, min(ttl_s / 6, 5.0))
        self.owner = uuid.uuid4().hex
        self.record = {"owner": self.owner, **describe_holder(), "ttl_s": ttl_s}
        self.notes: list[str] = []  # what the start should tell the user (a lease taken over)
        # Renewals and the release retry for at most a ttl: a later renewal is worth nothing, and a store that
        # is down must not hold up the end of a run for store.max_outage_s.
        self.background = RunStore(store.url, store.local, store.backoff_s, min(store.max_outage_s, ttl_s))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self, store: RunStore) -> dict[str, Any] | None:
        data = store.read_bytes(LEASE)
        if data is None:
            return None
        try:
            lease = json.loads(data)
        except ValueError:
            return None  # not a lease anyone can renew: as good as none
        return lease if isinstance(lease, dict) else None

    def _write(self, store: RunStore) -> None:
        self.record["renewed"] = time.time()
        store.write_bytes(LEASE, json.dumps(self.record, indent=1).encode())

    def _dead_at_once(self, lease: dict[str, Any]) -> str | None:
        """Why ``lease`` can be taken without waiting out its ttl, or None."""
        run_id = self.record["run_id"]
        if run_id and lease.get("run_id") == run_id:
            return f"it belongs to this torchrun job ({run_id}), restarted"
        namespace = self.record["namespace"]
        if namespace and lease.get("namespace") == namespace and isinstance(lease.get("pid"), int):
            try:
                os.kill(lease["pid"], 0)
            except ProcessLookupError:
                return f"its process {lease['pid']} on this machine is gone"
            except OSError:
                pass  # alive, someone else's
        renewed = lease.get("renewed")
        ttl = float(lease.get("ttl_s") or self.ttl_s)
        if isinstance(renewed, (int, float)) and time.time() - renewed > STALE_AFTER * ttl + CLOCK_SKEW_S:
            return f"it was last renewed {time.time() - renewed:.0f} s ago"
        return None

    def acquire(self) -> None:
        where = self.store.url
        seen, seen_at = None, 0.0
        while True:
            lease = self._read(self.store)
            if lease is not None and lease.get("owner") != self.owner:
                why = self._dead_at_once(lease)
                if why is None:
                    ttl = float(lease.get("ttl_s") or self.ttl_s)
                    mark = (lease.get("owner"), lease.get("renewed"))
                    if seen is None:
                        seen, seen_at = mark, time.monotonic()
                    elif mark != seen:
                        raise in_use(where, lease, f"; its lease {where}/{LEASE} was renewed within its {ttl:g} s ttl")
                    if time.monotonic() - seen_at <= ttl:
                        time.sleep(self.poll_s)
                        continue
                    why = f"it was not renewed for {ttl:g} s"
                self.notes.append(f"took over the lease {where}/{LEASE} of {_who(lease)}: {why}")
            self._write(self.store)
            time.sleep(self.settle_s)  # a simultaneous taker's write lands in this window
            after = self._read(self.store)
            if after is None:
                continue  # removed meanwhile (its holder ended): try again
            if after.get("owner") == self.owner:
                break
            raise in_use(where, after, "; it took the lease at the same time")
        self._thread = threading.Thread(target=self._renew, name="posttrain-lease", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        """Write the lease again now, e.g. after ``train.resume=never`` moved the store's objects aside."""
        self._write(self.background)

    def _renew(self) -> None:
        failing = False
        while not self._stop.wait(self.ttl_s / 3):
            try:
                lease = self._read(self.background)
                if lease is not None and lease.get("owner") != self.owner:
                    print(f"[posttrain] warning: the lease {self.store.url}/{LEASE} was taken by another run "
                          f"({_who(lease)}): two runs may now write into this output_dir", file=sys.stderr,
                          flush=True)
                    return
                self._write(self.background)
                failing = False
            except Exception as exc:  # noqa: BLE001 - the store being down is the training's to report; keep trying
                if not failing:
                    print(f"[posttrain] warning: renewing the lease {self.store.url}/{LEASE} failed ({exc}); "
                          "retrying", file=sys.stderr, flush=True)
                failing = True

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=self.ttl_s)
        self._thread = None
        try:
            lease = self._read(self.background)
            if lease is not None and lease.get("owner") == self.owner:
                self.background.remove(LEASE)
        except Exception:  # noqa: BLE001 - best effort: a lease left behind expires after its ttl
            pass


class RunLock:
    """What one run holds: the local directory's lock and, for a remote store, its lease. ``acquire``
    takes them in that order (releasing what it took when a later one is refused); ``release`` gives
    them back. Usable as a context manager."""

    def __init__(self, store: RunStore, ttl_s: float = LEASE_TTL_S):
        self.store = store
        where = f"{store.local} (the local mirror of {store.url})" if store.remote else str(store.local)
        path = store.local.parent / f".{store.local.name}{LOCK_FILE}" if store.remote else store.local / LOCK_FILE
        self.local = FileLock(path, where)
        self.lease = StoreLease(store, ttl_s) if store.remote else None
        self.notes: list[str] = []
        self.held = False

    def acquire(self) -> RunLock:
        if self.held:  # ``with lock_run(store):`` enters a lock that is already taken
            return self
        where = self.local.where
        try:
            self.store.local.mkdir(parents=True, exist_ok=True)
            self.local.acquire()
        except OSError as exc:
            if exc.errno in NOT_WRITABLE:
                raise not_writable(where, exc) from exc
            raise
        if self.lease is not None:
            try:
                self.lease.acquire()
            except BaseException:
                self.local.release()
                raise
            self.notes = self.lease.notes
        self.held = True
        return self

    def refresh(self) -> None:
        if self.lease is not None:
            self.lease.refresh()

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
        self.local.release()
        self.held = False
        if self in _HELD:
            _HELD.remove(self)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


_HELD: list[RunLock] = []  # this process's run locks: released when its run ends (``release_held``) or at exit


def lock_run(store: RunStore, ttl_s: float = LEASE_TTL_S) -> RunLock:
    """Take ``store``'s run lock for this process's run; raises ``RunDirError`` (exit 2) when another run holds
    it or the directory cannot be written. Released by ``release_held`` (the recipe's end) or at exit."""
    lock = RunLock(store, ttl_s).acquire()
    _HELD.append(lock)
    return lock


def release_held() -> None:
    """Release every run lock this process holds: its run is over (a process trains one run at a time)."""
    for lock in list(_HELD):
        lock.release()


atexit.register(release_held)
