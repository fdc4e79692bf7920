"""``python -m posttrain.k8s.store --port 29400``: serve a c10d TCPStore for torchrun's rendezvous, forever.

The coordinator pod runs this (see ``posttrain.k8s.coordinator``); torchrun agents connect to it as clients
(``--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-conf is_host=false``). SIGTERM ends it with exit 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.k8s.store", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    parser.add_argument("--port", type=int, default=29400, help="TCP port (default: 29400)")
    args = parser.parse_args(argv)

    from torch.distributed import TCPStore

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    # wait_for_workers=False: the store serves whoever comes, however many rounds the run takes.
    store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False)
    print(f"posttrain rendezvous store listening on {args.host}:{store.port}", file=sys.stderr, flush=True)
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
