"""``python -m posttrain.k8s.retryable -- COMMAND ...``: run COMMAND; its exit 75 becomes 138 for the
Kubeflow training operator.

The operator's ``restartPolicy: ExitCode`` restarts a replica only for exit codes of 128 and above
(``IsRetryableExitCode`` in kubeflow/training-operator ``pkg/util/train/train_util.go``, v1.9): 1–127 are
"permanent" errors. posttrain's resumable exit code is 75 (a checkpoint was saved; rerun to resume), which it
would take for permanent. This wrapper stays PID 1's child-keeper: it forwards SIGTERM/SIGINT to COMMAND (a
shell would not, and the kubelet's SIGTERM must reach ``posttrain launch`` to save a checkpoint), waits, and
exits with COMMAND's code, except that 75 becomes 138 (128 + SIGUSR1, the code the operator's documentation
sets aside for user-defined retryable errors). A COMMAND killed by signal N exits 128 + N, as a shell would.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from posttrain.exit_codes import EXIT_RESUMABLE

RETRYABLE_EXIT = 138


def exit_code_for_operator(code: int) -> int:
    """``code`` as the operator should see it: 75 → 138, killed by signal N (``-N``) → 128 + N."""
    if code < 0:
        return 128 + (-code)
    return RETRYABLE_EXIT if code == EXIT_RESUMABLE else code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m posttrain.k8s.retryable -- COMMAND [ARGS ...]", file=sys.stderr)
        return 2
    child = subprocess.Popen(argv)

    def forward(signum, frame):  # noqa: ARG001 - signal handler signature
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    return exit_code_for_operator(child.wait())


if __name__ == "__main__":
    sys.exit(main())
