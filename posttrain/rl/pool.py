"""A process pool that survives its tasks: a per-item timeout, and a hung or dead worker is replaced.

``TimeoutPool(handler, workers, timeout_s)`` starts ``workers`` processes once; ``run(jobs)`` returns one
:data:`Outcome` per job, in job order whatever order they finish in:

- ``("ok", handler(job))``;
- ``("error", reason)`` when the handler raised (``"error: ValueError"``; ``BadValue("reason")`` sends its
  reason as it is);
- ``("timeout", None)`` when one job ran past ``timeout_s``: its worker is SIGKILLed and replaced;
- ``("crashed", None)`` when the worker died under it (segfault, ``os._exit``, OOM kill): replaced.

Why not ``concurrent.futures.ProcessPoolExecutor`` (what ``posttrain.curate.executor`` uses): it cannot kill
one running task, and one dead worker breaks the whole pool (``BrokenProcessPool``) for every later call.
Workers are fresh interpreters (``python -c``, a socket pair to the parent, the parent's ``sys.path``), not
``multiprocessing`` spawn children: spawn re-runs the parent's ``__main__`` in every worker, which fails from
stdin or a notebook and re-runs a script that has no ``if __name__ == "__main__"`` guard; a fork would copy
torch's threads and CUDA state.

Jobs travel in chunks (one pickle per chunk: shared objects inside it, such as a prompt scored G times, are
pickled once). Each result is written back the moment it is done, as its own length-prefixed frame with the
time it finished (``CLOCK_MONOTONIC`` is one clock for all processes): bytes written before a worker dies
stay readable, so the parent can always tell which job a worker was on and since when — the deadline is per
job, not per chunk. The parent does not wake per result: it sleeps on each worker's *bell*, a pipe that gets
one byte per finished chunk and reads end-of-file when the worker dies, or until the nearest deadline, and
then reads every waiting frame with one ``recv``. When a worker dies or is killed, the job it was on is
blamed and the rest of its chunk goes back to the front of the queue.
"""

from __future__ import annotations

import importlib
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

Outcome = tuple[str, Any]  # ("ok", value) | ("error", reason) | ("timeout", None) | ("crashed", None)

MAX_CHUNK = 32  # jobs per message to a worker; small enough to keep the workers evenly loaded
START_TIMEOUT_S = 120.0  # a worker not ready by then (stuck importing) is a setup failure
_HEADER = struct.Struct("<I")
_ENTRY = ("import sys; from posttrain.rl.pool import _worker_main; "
          "_worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))")


class BadValue(Exception):
    """Raised by a handler to report ``reason`` verbatim as the job's failure (e.g. "not a number: str")."""


class PoolError(RuntimeError):
    """The pool itself cannot run (a worker died or hung while starting)."""


def failure_reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, BadValue) else f"error: {type(exc).__name__}"


def run_inline(handler: Callable[[Any], Any], job: Any) -> Outcome:
    """One job in this process: exceptions become outcomes; there is no timeout or crash protection."""
    try:
        return "ok", handler(job)
    except Exception as exc:  # a reward function's bug is a counted failure, not a dead run
        return "error", failure_reason(exc)


def _frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def _read_frame(reader: BinaryIO) -> Any:
    header = reader.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    payload = reader.read(size)
    if len(payload) < size:
        raise EOFError
    return pickle.loads(payload)


# --- the worker ------------------------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    # A worker whose parent died (SIGKILL, OOM) would otherwise live on, e.g. inside a hung reward function.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def _worker_main(fd: int, bell: int, parent_pid: int) -> None:
    """A worker's life: the parent's sys.path, then the handler, then chunks until the end message or EOF."""
    # Ctrl-C and a SIGTERM to the process group reach the workers too: the parent decides what happens to a
    # step in flight (a checkpoint on SIGTERM must not hold rewards zeroed by dead workers). The parent ends
    # them: an end message, EOF when it exits, SIGKILL on a timeout; _watch_parent when it dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for key, value in (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    sock = socket.socket(fileno=fd)
    reader = sock.makefile("rb")
    try:
        sys.path[:] = _read_frame(reader)  # first: the handler is imported by name from the parent's path
        module, _, name = _read_frame(reader).partition(":")
        handler = getattr(importlib.import_module(module), name)
        sock.sendall(_frame(("ready", None, None, time.monotonic())))
        os.write(bell, b".")
        while True:
            chunk = _read_frame(reader)
            if chunk is None:
                return
            for job_id, job in chunk:
                try:
                    result = (job_id, "ok", handler(job))
                except BaseException as exc:  # SystemExit from sys.exit() in a reward function included
                    result = (job_id, "error", failure_reason(exc))
                sock.sendall(_frame((*result, time.monotonic())))
            os.write(bell, b".")
    except (EOFError, OSError):
        return  # the parent closed the pool or died


# --- the parent ------------------------------------------------------------------------------------


@dataclass
class _Worker:
    process: subprocess.Popen
    sock: socket.socket
    bell: int  # read end of the worker's bell pipe
    started: float
    ready: bool = False
    pending: deque = field(default_factory=deque)  # job ids sent, not yet answered; the head is running
    since: float = 0.0  # when the head job started (chunk sent, or the previous result finished)
    buffer: bytearray = field(default_factory=bytearray)


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


class TimeoutPool:
    """``workers`` processes that run ``handler(job)``; ``handler`` is a module-level function (sent by name)."""

    def __init__(self, handler: Callable[[Any], Any], workers: int, timeout_s: float):
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker (got {workers}); run in-process instead")
        self.timeout_s = float(timeout_s)
        self.replaced = 0  # workers killed or found dead and started again, over the pool's life
        self._handler_ref = f"{handler.__module__}:{handler.__qualname__}"
        self._selector = selectors.DefaultSelector()
        self._workers = [self._start() for _ in range(workers)]
        self._closed = False

    def _start(self) -> _Worker:
        mine, theirs = socket.socketpair()
        bell, ringer = os.pipe()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(theirs.fileno()), str(ringer), str(os.getpid())],
                pass_fds=[theirs.fileno(), ringer], stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()  # only the child holds its ends now: its death reads as end-of-file here
            os.close(ringer)
        os.set_blocking(bell, False)
        mine.sendall(_frame(list(sys.path)) + _frame(self._handler_ref))
        self._selector.register(bell, selectors.EVENT_READ)
        return _Worker(process, mine, bell, time.monotonic())

    def _replace(self, index: int) -> None:
        if self._closed:
            raise PoolError("the reward pool was closed during a run")
        old = self._workers[index]
        _kill(old.process)
        self._selector.unregister(old.bell)
        os.close(old.bell)
        old.sock.close()
        self._workers[index] = self._start()
        self.replaced += 1

    def run(self, jobs: Sequence[Any]) -> list[Outcome]:
        if self._closed:
            raise PoolError("the reward pool is closed")
        results: list[Outcome | None] = [None] * len(jobs)
        queue = deque(range(len(jobs)))
        left = len(jobs)
        while left:
            if self._closed:  # close() from another thread: stop, start nothing new
                raise PoolError("the reward pool was closed during a run")
            self._dispatch(jobs, queue)
            self._wait()
            now = time.monotonic()
            for index, worker in enumerate(self._workers):
                received, dead = self._drain(worker, results)
                left -= received
                if dead is None and worker.pending and now - worker.since > self.timeout_s:
                    dead = "timeout"
                if dead is not None:
                    if not worker.ready:
                        raise PoolError(f"a reward worker died while starting (exit code {worker.process.poll()}); "
                                        "its error is above")
                    if worker.pending:
                        results[worker.pending.popleft()] = (dead, None)
                        left -= 1
                        queue.extendleft(reversed(worker.pending))
                    self._replace(index)
                elif not worker.ready and now - worker.started > START_TIMEOUT_S:
                    raise PoolError(f"a reward worker was not ready after {START_TIMEOUT_S:g}s")
        return results  # type: ignore[return-value]

    def _dispatch(self, jobs: Sequence[Any], queue: deque) -> None:
        for worker in self._workers:
            if not queue:
                return
            if not worker.ready or worker.pending:
                continue
            size = max(1, min(MAX_CHUNK, -(-len(queue) // (2 * len(self._workers)))))
            chunk = [queue.popleft() for _ in range(min(size, len(queue)))]
            try:
                # Blocking is safe: an idle worker is waiting to read, it writes nothing until it has the chunk.
                worker.sock.sendall(_frame([(job_id, jobs[job_id]) for job_id in chunk]))
            except OSError:
                queue.extendleft(reversed(chunk))  # died while idle: _drain finds it dead and replaces it
                continue
            worker.pending.extend(chunk)
            worker.since = time.monotonic()

    def _wait(self) -> None:
        deadlines = [w.since + self.timeout_s for w in self._workers if w.pending]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0
        self._selector.select(timeout)

    def _drain(self, worker: _Worker, results: list[Outcome | None]) -> tuple[int, str | None]:
        """Read every frame the worker has sent: (results received, "crashed" if it is gone, else None)."""
        alive = worker.process.poll() is None  # checked first: what it wrote before dying is read below
        ended = False
        while True:  # the bell: one byte per finished chunk; end-of-file when the worker is gone
            try:
                if not os.read(worker.bell, 4096):
                    ended = True
                    break
            except BlockingIOError:
                break
        while True:
            try:
                data = worker.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                ended = True
                break
            if not data:
                ended = True
                break
            worker.buffer += data
        received = 0
        while len(worker.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(worker.buffer)
            if len(worker.buffer) < _HEADER.size + size:
                break
            message = pickle.loads(worker.buffer[_HEADER.size : _HEADER.size + size])
            del worker.buffer[: _HEADER.size + size]
            job_id, status, value, finished = message
            worker.since = finished  # the next pending job started then
            if job_id == "ready":
                worker.ready = True
                continue
            if worker.pending and worker.pending[0] == job_id:  # results come in the order the jobs were sent
                worker.pending.popleft()
            results[job_id] = (status, value)
            received += 1
        return received, "crashed" if ended or not alive else None

    def close(self) -> None:
        """Stop the workers: an end message, then SIGKILL for any still busy after 2 s."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.sock.sendall(_frame(None))
            except OSError:
                pass
        end = time.monotonic() + 2.0
        for worker in self._workers:
            try:
                worker.process.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(worker.process)
            worker.sock.close()
            os.close(worker.bell)
        self._selector.close()

    def __enter__(self) -> TimeoutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
