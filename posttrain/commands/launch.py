"""``posttrain launch [torchrun options] -- COMMAND [ARGS]``: torchrun with posttrain's exit codes.

A scheduler preempts a distributed job by sending SIGTERM to the process it started — torchrun's agent.
The agent passes the signal to the workers (each finishes its step, saves a checkpoint and exits 75),
waits for them, and then dies with a ``SignalException`` traceback and exit code 1, so the job looks
failed although it saved and can resume. ``posttrain launch`` runs the same agent in this process and
keeps the promise of ``posttrain``'s exit codes: 75 when the run can resume (a signal to the agent or to the
workers, or a rank whose stall watchdog fired while its peers died of the broken collective), 1 with one line
naming the failed ranks otherwise, 0 when every worker finished.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from posttrain.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_RESUMABLE, LAUNCH_MARKS_ENV, read_launch_marks


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="Run a posttrain command on several processes/nodes with torchrun; preemption exits 75, not 1.",
        description=__doc__.split("\n", 2)[2],
        usage="posttrain launch [torchrun options, e.g. --nproc_per_node 2] -- COMMAND [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="torchrun options, then --, then the command")
    # ``posttrain.cli.main`` calls ``launch`` before argparse sees torchrun's options; this is for --help.
    parser.set_defaults(func=lambda args: launch(list(args.arguments)))


def split_arguments(arguments: list[str]) -> tuple[list[str], list[str]]:
    """``(torchrun options, posttrain command)`` split at the first ``--``."""
    if "--" not in arguments:
        raise SystemExit("posttrain launch: separate the torchrun options from the command with --, e.g. "
                         "posttrain launch --nproc_per_node 2 -- sft --config sft_tiny")
    cut = arguments.index("--")
    command = arguments[cut + 1 :]
    if not command:
        raise SystemExit("posttrain launch: no command after --")
    return arguments[:cut], command


def failure_outcome(failures: dict[int, tuple[int, int]], marks: list[dict]) -> tuple[int, str]:
    """Exit code and one line for a group that failed: ``failures`` maps rank to ``(pid, exit code)`` of the
    final attempt's failed workers; ``marks`` are what workers left (``posttrain.exit_codes``). Only marks of
    those processes count, so an earlier attempt's stall does not make a later real failure look resumable.

    A stall is resumable whatever the peers exited with: they die of the collective the stalled rank broke."""
    pids = {pid for pid, _ in failures.values()}
    current = [mark for mark in marks if mark.get("pid") in pids]
    codes = ", ".join(f"rank {rank} exited with {code}" for rank, (_, code) in sorted(failures.items()))
    stalled = [mark for mark in current if mark.get("kind") == "stalled"]
    if stalled:
        first = stalled[0]
        ranks = ", ".join(str(mark.get("rank")) for mark in stalled)
        return EXIT_RESUMABLE, (f"posttrain launch: stalled: no progress on rank {ranks} at step {first.get('step')} "
                                f"(health.stall_timeout_s; the stacks are above) and the group ended ({codes}); "
                                "rerun the same command to resume from the newest checkpoint")
    if {code for _, code in failures.values()} == {EXIT_RESUMABLE} or any(
            mark.get("kind") == "preempted" for mark in current):
        return EXIT_RESUMABLE, "posttrain launch: preempted; rerun the same command to resume"
    return EXIT_FAILED, f"posttrain launch: {codes} (see its output above)"


def launch(arguments: list[str]) -> int:
    """Run ``torchrun OPTIONS -m posttrain COMMAND`` in this process; return posttrain's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    options, command = split_arguments(arguments)
    with tempfile.TemporaryDirectory(prefix="posttrain-launch-") as scratch:
        marks_file = Path(scratch) / "marks.jsonl"
        os.environ[LAUNCH_MARKS_ENV] = str(marks_file)
        # torchrun's agent shares one TCPStore with the workers across restarts (torch >= 2.5), and a restarted
        # group can read its predecessor's gloo/NCCL addresses from it: connection refused, or a hang in
        # init_process_group (pytorch/pytorch#135712; 2 of 4 restarts here, none of 5 with this; docs/stalls.md).
        # Unshared, each attempt's rank 0 hosts a fresh store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        torchrun_args = get_args_parser().parse_args([*options, "-m", "posttrain", *command])
        try:
            run(torchrun_args)
        except SignalException as exc:
            steps = [mark["step"] for mark in read_launch_marks(marks_file)
                     if mark.get("kind") == "preempted" and mark.get("step") is not None]
            saved = f"checkpoint at step {steps[-1]} saved" if steps else "no new checkpoint saved"
            print(f"posttrain launch: preempted by {exc.sigval.name}: {saved}; rerun the same command to resume",
                  file=sys.stderr)
            return EXIT_RESUMABLE
        except ChildFailedError as exc:
            failures = {rank: (failure.pid, failure.exitcode) for rank, failure in exc.failures.items()}
            code, line = failure_outcome(failures, read_launch_marks(marks_file))
            print(line, file=sys.stderr)
            return code
    return EXIT_OK
