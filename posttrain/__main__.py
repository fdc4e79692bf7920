"""``python -m posttrain`` and the ``posttrain`` command: run the CLI, then leave (``exit_process``: a
distributed rank skips interpreter teardown, which can abort a finished rank; so does a successful command of
``TEARDOWN_FREE_COMMANDS``, for which it would only free memory). A closed stdout pipe is no
failure: ``posttrain validate … | head`` exits as the command did, without a traceback.
"""

import sys

from posttrain.cli import TEARDOWN_FREE_COMMANDS, command_of, main, silence_stdout, stdout_closed
from posttrain.exit_codes import EXIT_OK, exit_process


def entry() -> None:
    try:
        code = int(main() or 0)
    except BrokenPipeError:  # `posttrain --help | head`: argparse writes before any command's own handling
        if not stdout_closed():
            raise
        code = EXIT_OK
    finally:
        try:
            sys.stdout.flush()  # a reader that left shows here, not as a traceback in the interpreter's teardown
        except BrokenPipeError:
            silence_stdout()
    exit_process(code, teardown=code != EXIT_OK or command_of(sys.argv[1:]) not in TEARDOWN_FREE_COMMANDS)


if __name__ == "__main__":
    entry()
