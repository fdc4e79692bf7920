"""``python -m posttrain`` and the ``posttrain`` command: run the CLI, then leave (``exit_process``: a
distributed rank skips interpreter teardown, which can abort a finished rank).
"""

from posttrain.cli import main
from posttrain.exit_codes import exit_process


def entry() -> None:
    exit_process(int(main() or 0))


if __name__ == "__main__":
    entry()
