"""Stall watchdog: a rank that makes no progress for ``health.stall_timeout_s`` reports its stacks and exits 75.

A distributed job fails in two ways. A lost process (a node gone, an OOM kill) is seen by torchrun's
agent, which restarts the group (``--max-restarts``). A *hung* process is seen by no one: one rank stuck
in a dead NFS read or an endless loop, and its peers wait in their next collective — for the process
group's timeout (30 min here), or for ever where a collective has none. The job looks alive and burns
its nodes.

Each rank runs a ``Watchdog``: a daemon thread the loop tells about progress with ``beat(phase, step)`` —
before each step, each evaluation and each checkpoint save, so every phase gets the whole timeout to
itself and a long legitimate save or first step (warm-up) is not a stall; ``paused()`` switches it off
around a phase that has a timeout of its own. When no beat comes for ``timeout_s`` seconds it

1. writes the Python stack of every thread to stderr (``faulthandler``: what the rank was doing),
2. records a ``stalled`` alert — rank, step, phase, seconds since the last progress, and the stacks,
   each cut to its innermost ``STACK_CHARS`` characters — through ``Alerts`` on rank 0
   (``alerts.jsonl``, the webhook); a rank above 0 prints the line on stderr and appends the event to
   ``output_dir/alerts-rank{r}.jsonl`` (``Alerts.emit_own``), because ``Alerts`` writes on rank 0 only and rank 0 may be the
   healthy one,
3. ends the process with ``os._exit(75)``: a thread blocked in a collective cannot be unwound, and an
   exception on the watchdog thread would not reach it. 75 is ``EXIT_RESUMABLE``, the code a launcher
   already restarts on: torchrun's agent sees a failed worker, stops the others and restarts the group
   (``--max-restarts``), and the run resumes from its newest checkpoint; under Kubernetes, a pod
   restart policy on exit code 75 does the same for the whole job (docs/stalls.md).

The watchdog thread needs the GIL, which a thread waiting in a collective, ``time.sleep`` or I/O
releases; a hang inside C code that holds the GIL is not caught here.

This module also holds the drills' targeting (``drill_step``): a drill fires in the first attempt of a
run only, so the group torchrun restarts after it does not crash again.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from posttrain import dist
from posttrain.exit_codes import EXIT_RESUMABLE, mark_stalled
from posttrain.train.health import Alerts

STALL_EXIT_CODE = EXIT_RESUMABLE
STACK_CHARS = 4000  # per thread in the alert; stderr has the whole stacks
EXIT_GRACE_S = 30.0  # the alert (a webhook, a dead disk) may hang too: exit after this long regardless


class Watchdog:
    """Exit the process with ``STALL_EXIT_CODE`` when ``beat`` is not called for ``timeout_s`` seconds.

    ``timeout_s=None`` switches it off (every method is then a no-op). Use as a context manager: the
    thread starts on entry and stops on exit, also when the watched code raises. ``exit_process`` is how the
    process ends (``os._exit``; a test passes a recorder).
    """

    def __init__(self, timeout_s: float | None, alerts: Alerts, exit_process: Callable[[int], Any] = os._exit) -> None:
        self.timeout_s, self.alerts, self._exit = timeout_s, alerts, exit_process
        self._last = time.monotonic()
        self._phase, self._step = "setup", 0
        self._paused = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: dict[str, Any] | None = None  # the alert, once it fired

    def __enter__(self) -> Watchdog:
        if self.timeout_s is not None:
            self._last = time.monotonic()
            # A tenth of the timeout: a stall is reported at most 10% late; never busier than 20 polls a second.
            poll = max(0.05, min(5.0, self.timeout_s / 10))
            self._thread = threading.Thread(target=self._watch, args=(poll,), name="posttrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self, phase: str, step: int) -> None:
        """Progress: the rank is about to start ``phase`` (``"step"``, ``"evaluation"``, …) at ``step``."""
        with self._lock:
            self._last, self._phase, self._step = time.monotonic(), phase, step

    @contextmanager
    def paused(self, phase: str, step: int) -> Iterator[None]:
        """No stall is reported inside (a phase with a timeout of its own); the clock restarts after it."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last, self._phase, self._step = time.monotonic(), phase, step

    def _watch(self, poll: float) -> None:
        while not self._stop.wait(poll):
            with self._lock:
                idle = time.monotonic() - self._last
                stalled = not self._paused and idle > self.timeout_s
                phase, step = self._phase, self._step
            if stalled:
                self._fire(phase, step, idle)
                return

    def _fire(self, phase: str, step: int, idle: float) -> None:
        # Whatever happens while reporting, the process ends: a reporting path that hangs too must not
        # keep the group alive.
        backstop = threading.Timer(EXIT_GRACE_S, self._exit, args=(STALL_EXIT_CODE,))
        backstop.daemon, backstop.name = True, "posttrain-watchdog-exit"
        backstop.start()
        rank = dist.rank()
        message = (f"rank {rank}: no progress for {idle:.0f} s ({phase} at step {step}; health.stall_timeout_s="
                   f"{self.timeout_s:g}); exiting {STALL_EXIT_CODE} so the launcher restarts the group from the "
                   "newest checkpoint (stacks above)")
        try:
            mark_stalled(rank, step, idle)  # so `posttrain launch` ends 75 though the peers die with 1
            _dump_stacks_to_stderr(rank)
            fields = {"rank": rank, "step": step, "phase": phase, "seconds_since_progress": round(idle, 3),
                      "timeout_s": self.timeout_s, "exit_code": STALL_EXIT_CODE, "stacks": thread_stacks()}
            self.fired = self.alerts.emit_own("stalled", message=message, **fields)
        finally:
            sys.stderr.flush()
            backstop.cancel()
            self._exit(STALL_EXIT_CODE)


def thread_stacks(limit: int = STACK_CHARS) -> dict[str, str]:
    """``{"<thread name> (<id>)": stack}`` for every thread but the watchdog's own, the main thread first, each cut
    to its last ``limit`` characters (the innermost frames: where it is stuck)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    stacks = {}
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: item[0] != main):
        if ident == threading.get_ident() or names.get(ident, "").startswith("posttrain-watchdog"):
            continue
        text = "".join(traceback.format_stack(frame))
        stacks[f"{names.get(ident, 'thread')} ({ident})"] = text if len(text) <= limit else "…" + text[-limit:]
    return stacks


def _dump_stacks_to_stderr(rank: int) -> None:
    print(f"[posttrain] rank {rank}: stalled; Python stacks of every thread:", file=sys.stderr, flush=True)
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # stderr without a file descriptor (captured in a test)
        for name, stack in thread_stacks(limit=1 << 30).items():
            print(f"Thread {name}:\n{stack}", file=sys.stderr)


RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun's agent: 0 in the first attempt


def first_attempt() -> bool:
    """True unless torchrun restarted this group (its restart count is above 0)."""
    return int(os.environ.get(RESTART_COUNT_ENV) or 0) == 0


def drill_step(step: int | None, only_rank: int | None) -> int | None:
    """The step at which a drill fires in this process, or None: only on ``only_rank`` (every rank when
    None), and only in the first attempt of an elastic run, so the restarted group trains to the end."""
    if step is None or not first_attempt() or (only_rank is not None and only_rank != dist.rank()):
        return None
    return step


def hang_forever() -> None:
    """The stall drill (``debug.hang_at_step``): sleep until killed. A signal handler runs and the sleep goes on,
    as in a real hang, so only the watchdog or the launcher's SIGKILL ends it."""
    while True:
        time.sleep(3600)
