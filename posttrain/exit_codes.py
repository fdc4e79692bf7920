"""Process exit codes of every posttrain command (documented in the README and in ``posttrain --help``),
and the two signals a preempted process leaves for whoever launched it."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
from pathlib import Path

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2  # bad config or bad input: the message names file, line and field
EXIT_RESUMABLE = 75  # preempted (SIGTERM/SIGINT): a checkpoint was saved; rerun the same command to resume

# ``posttrain launch`` sets this to a file path. A worker that is about to exit 75 appends one JSON line there
# (``{"kind": "preempted" | "stalled", "pid": …, …}``), so the launcher can end with 75, and say why, when torchrun's
# agent itself was signalled or when the peers of a stalled rank died of the broken collective (exit 1).
LAUNCH_MARKS_ENV = "POSTTRAIN_LAUNCH_MARKS"


class Preempted(BaseException):  # noqa: N818 - like KeyboardInterrupt, it is a request, not an error
    """SIGTERM/SIGINT arrived outside the training loop (before it started, or after it ended).

    A BaseException, so no ``except Exception`` on the way swallows it; the CLI turns it into exit 75.
    """


def _mark(kind: str, **fields) -> None:
    path = os.environ.get(LAUNCH_MARKS_ENV)
    if path:
        try:
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"kind": kind, "pid": os.getpid(), **fields}) + "\n")
        except OSError:
            pass  # the exit code 75 says the same; the file only helps the launcher


def mark_preempted(step: int | None) -> None:
    """Tell ``posttrain launch`` that this process was preempted (``step``: the checkpoint saved, if any)."""
    _mark("preempted", step=step)


def mark_stalled(rank: int, step: int, idle_s: float) -> None:
    """Tell ``posttrain launch`` that this process's stall watchdog is ending it (exit 75)."""
    _mark("stalled", rank=rank, step=step, idle_s=round(idle_s, 1))


def read_launch_marks(path: str | os.PathLike) -> list[dict]:
    """The marks the workers left in ``path`` (none when it does not exist); a torn last line is skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    marks = []
    for line in lines:
        try:
            mark = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(mark, dict):
            marks.append(mark)
    return marks


def raise_preempted_on_signals() -> None:
    """Until the training loop installs its own handlers: SIGTERM/SIGINT end the process cleanly (exit 75)."""

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        raise Preempted(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def report_preempted(exc: Preempted, step: int | None = None) -> int:
    mark_preempted(step)
    print(f"posttrain: preempted by {exc.args[0] if exc.args else 'a signal'} outside the training loop; nothing "
          "new to save — rerun the same command to continue from the last checkpoint (exit 75)", file=sys.stderr)
    return EXIT_RESUMABLE


def _nothing_waits() -> bool:
    """No thread the interpreter would wait for at exit (not a daemon) is running, and no profiler or tracer
    (``python -m cProfile``, coverage) is attached: those write their results after the program ends."""
    threads = any(not thread.daemon for thread in threading.enumerate() if thread is not threading.main_thread())
    return not threads and sys.getprofile() is None and sys.gettrace() is None


def exit_process(code: int, teardown: bool = True) -> None:
    """End the process with ``code``. A distributed rank (``WORLD_SIZE`` > 1) skips interpreter teardown after
    flushing its output: with the process group already destroyed, teardown can still abort a rank
    ("terminate called without an active exception": gloo's C++ threads release tensors while Python
    finalises, pytorch#179291) and turn a finished run into a failed one. ``teardown=False`` skips it too, after
    the exit handlers (``atexit``: locks, engines, Ray), for a command that has written and closed all it makes:
    teardown would only free its objects one by one (0.07 s of a 2.7 s ``posttrain curate`` over 30k long
    records, whose rows and arrays are still alive at its end). Call it last, files closed."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed or (not teardown and _nothing_waits()):
        if not distributed:
            atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)

