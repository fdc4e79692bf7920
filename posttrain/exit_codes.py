"""Process exit codes of every posttrain command (documented in the README and in ``posttrain --help``),
and the two signals a preempted process leaves for whoever launched it."""

from __future__ import annotations

import os
import signal
import sys

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2  # bad config or bad input: the message names file, line and field
EXIT_RESUMABLE = 75  # preempted (SIGTERM/SIGINT): a checkpoint was saved; rerun the same command to resume

# ``posttrain launch`` sets this to a file path; a rank that exits 75 writes the step it saved there, so the
# launcher can end with 75 when torchrun's agent itself was the one signalled.
PREEMPTED_FILE_ENV = "POSTTRAIN_PREEMPTED_FILE"


class Preempted(BaseException):  # noqa: N818 - like KeyboardInterrupt, it is a request, not an error
    """SIGTERM/SIGINT arrived outside the training loop (before it started, or after it ended).

    A BaseException, so no ``except Exception`` on the way swallows it; the CLI turns it into exit 75.
    """


def mark_preempted(step: int | None) -> None:
    """Tell ``posttrain launch`` that this process was preempted (``step``: the checkpoint saved, if any)."""
    path = os.environ.get(PREEMPTED_FILE_ENV)
    if path:
        try:
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(f"{step if step is not None else ''}\n")
        except OSError:
            pass  # the exit code 75 says the same; the file only helps the launcher


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
