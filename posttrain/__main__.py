"""``python -m posttrain`` and the ``posttrain`` command: run the CLI, then leave.

Under torchrun every file is closed and the process group destroyed when ``main`` returns, yet
interpreter teardown can still abort a rank ("terminate called without an active exception": gloo's
C++ threads release tensors while Python finalises, pytorch#179291), turning a finished run into a
failed one. A distributed rank therefore exits without that teardown, after flushing its output.
"""

import os
import sys

from posttrain.cli import main


def entry() -> None:
    code = int(main() or 0)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    entry()
