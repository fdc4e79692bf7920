"""``posttrain launch [torchrun options] -- COMMAND [ARGS]``: torchrun with posttrain's exit codes.

A scheduler preempts a distributed job by sending SIGTERM to the process it started — torchrun's agent.
The agent passes the signal to the workers (each finishes its step, saves a checkpoint and exits 75),
waits for them, and then dies with a ``SignalException`` traceback and exit code 1, so the job looks
failed although it saved and can resume. ``posttrain launch`` runs the same agent in this process and
keeps the promise of ``posttrain``'s exit codes: 75 when the run was preempted (by a signal to the agent or
to the workers), 1 with one line naming the failed ranks otherwise, 0 when every worker finished.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from posttrain.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_RESUMABLE, PREEMPTED_FILE_ENV


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


def _preempted_steps(flag: Path) -> list[str]:
    return [line for line in flag.read_text().splitlines()] if flag.exists() else []


def launch(arguments: list[str]) -> int:
    """Run ``torchrun OPTIONS -m posttrain COMMAND`` in this process; return posttrain's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    options, command = split_arguments(arguments)
    with tempfile.TemporaryDirectory(prefix="posttrain-launch-") as scratch:
        flag = Path(scratch) / "preempted"
        os.environ[PREEMPTED_FILE_ENV] = str(flag)
        # torchrun's agent shares one TCPStore with the workers across restarts (torch >= 2.5), and a restarted
        # group can read its predecessor's gloo/NCCL addresses from it: connection refused, or a hang in
        # init_process_group (pytorch/pytorch#135712; 2 of 4 restarts here, none of 5 with this; docs/stalls.md).
        # Unshared, each attempt's rank 0 hosts a fresh store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        torchrun_args = get_args_parser().parse_args([*options, "-m", "posttrain", *command])
        try:
            run(torchrun_args)
        except SignalException as exc:
            steps = [s for s in _preempted_steps(flag) if s]
            saved = f"checkpoint at step {steps[0]} saved" if steps else "no new checkpoint saved"
            print(f"posttrain launch: preempted by {exc.sigval.name}: {saved}; rerun the same command to resume",
                  file=sys.stderr)
            return EXIT_RESUMABLE
        except ChildFailedError as exc:
            codes = {failure.exitcode for failure in exc.failures.values()}
            if codes == {EXIT_RESUMABLE} or _preempted_steps(flag):
                print("posttrain launch: preempted; rerun the same command to resume", file=sys.stderr)
                return EXIT_RESUMABLE
            failed = ", ".join(f"rank {rank} exited with {failure.exitcode}" for rank, failure in
                               sorted(exc.failures.items()))
            print(f"posttrain launch: {failed} (see its output above)", file=sys.stderr)
            return EXIT_FAILED
    return EXIT_OK
