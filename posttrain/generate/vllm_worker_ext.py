"""posttrain's vLLM worker extension: the engine receives the trainer's weights over a collective
(``rollout.sync_method: broadcast``), no file in between.

**Standalone.** This file runs inside the engine's own Python (``.venv-vllm``), which has no posttrain: it
imports only the standard library and torch. ``VLLMServer`` copies it as ``posttrain_vllm_ext.py`` into a
directory of its own, puts that directory on the engine's ``PYTHONPATH`` and starts vLLM with
``--worker-extension-cls posttrain_vllm_ext.WeightReceiver``; vLLM then mixes ``WeightReceiver`` into its worker
class, and its methods are callable through the dev-mode endpoint ``/collective_rpc``. The trainer side
(``posttrain.rl.weight_broadcast``) imports the helpers below from here, so both ends share one layout.

**The protocol.** A process group of two ranks of its own — rank 0 the trainer's main rank, rank 1 the engine's
worker — on a TCPStore the trainer hosts; a standalone ``ProcessGroupGloo`` (CPU tensors) or ``ProcessGroupNCCL``
(CUDA tensors), not ``init_process_group``: each side keeps its own default group. Per sync the trainer sends a
*layout* (JSON: buckets of ``[name, dtype, shape]``) in the ``receive_weights`` call, then broadcasts one flat
byte buffer per bucket, in order; the worker receives each, cuts it into the named tensors and streams them into
vLLM's in-place reload (``Worker.reload_weights(weights_iterator=…)``: the same layerwise reload, and so the same
numerics, as reloading from a safetensors file). Before the first broadcast of a sync the worker sets
``ready/<sync>`` in the store, so a trainer whose call failed early (no extension, an engine that is down) never
waits on a broadcast nobody receives.
"""

from __future__ import annotations

import datetime
import json
import math
import socket
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["EXTENSION_CLS", "WeightReceiver", "broadcast", "install", "local_address", "open_group"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
          "int8": torch.int8, "bool": torch.bool}
STORE_PREFIX = "posttrain-weights"
STALE = "this worker is not in the weight group"
MODULE = "posttrain_vllm_ext"
EXTENSION_CLS = f"{MODULE}.WeightReceiver"


def tensor_bytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=DTYPES[dtype]).element_size()


def bucket_bytes(bucket: list[list]) -> int:
    """Bytes of one bucket of ``[name, dtype, shape]`` entries, packed back to back."""
    return sum(tensor_bytes(dtype, shape) for _, dtype, shape in bucket)


def local_address(peer_host: str) -> str:
    """This machine's address on the route to ``peer_host`` (``127.0.0.1`` for a loopback peer): the address
    the peer can reach us at. No packet is sent (a UDP socket's ``connect`` only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((peer_host, 9))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def open_group(store: torch.distributed.Store, rank: int, world: int, backend: str, address: str,
               timeout_s: float, name: str) -> torch.distributed.ProcessGroup:
    """A standalone process group of ``world`` ranks over ``store`` (keys under ``name``): gloo listening on
    ``address``, or NCCL (CUDA tensors; the current CUDA device). Blocks until every rank has joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = torch.distributed.PrefixStore(f"{STORE_PREFIX}/{name}/", store)
    if backend == "gloo":
        options = torch.distributed.ProcessGroupGloo._Options()
        options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=address)]
        options._timeout = timeout
        return torch.distributed.ProcessGroupGloo(prefixed, rank, world, options)
    if backend == "nccl":
        if not hasattr(torch.distributed, "ProcessGroupNCCL"):
            raise RuntimeError("rollout.sync_backend=nccl needs a CUDA build of torch with NCCL on both sides")
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(prefixed, rank, world, options)
    raise ValueError(f"unknown weight-sync backend {backend!r}: gloo or nccl")


def broadcast(group: Any, tensor: torch.Tensor, wait: bool = True) -> Any:
    """Broadcast ``tensor`` from rank 0 of ``group`` in place; wait for it, or return the work to wait on."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    work = group.broadcast([tensor], options)
    return work.wait() if wait else work


class _Received:
    """The tensors of one sync as they arrive: ``(name, tensor)`` per layout entry, one broadcast per bucket; the
    next bucket's receive is posted before this one's tensors are loaded, so transfer and reload overlap.
    ``drain()`` receives (and drops) the buckets not consumed yet, so the sender never waits on a receiver that
    gave up."""

    def __init__(self, group: Any, buckets: list[list], device: torch.device):
        self.group, self.buckets, self.device = group, buckets, device
        self.posted = 0
        self.pending: tuple[torch.Tensor, Any] | None = None
        self.tensors = self.bytes = 0

    def _post(self) -> None:
        """Post the receive of the next bucket, if any (a fresh buffer: the reload may keep views of the last)."""
        self.pending = None
        if self.posted < len(self.buckets):
            flat = torch.empty(bucket_bytes(self.buckets[self.posted]), dtype=torch.uint8, device=self.device)
            self.pending = (flat, broadcast(self.group, flat, wait=False))
            self.posted += 1

    def _next(self) -> torch.Tensor:
        flat, work = self.pending
        work.wait()
        self.bytes += flat.numel()
        self._post()
        return flat

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._post()
        while self.pending is not None:
            entries = self.buckets[self.posted - 1]
            flat, offset = self._next(), 0
            for name, dtype, shape in entries:
                size = tensor_bytes(dtype, shape)
                self.tensors += 1
                yield name, flat[offset:offset + size].view(DTYPES[dtype]).view(shape)
                offset += size

    def drain(self) -> None:
        if self.pending is None and self.posted == 0:
            self._post()
        while self.pending is not None:
            self._next()


class WeightReceiver:
    """Mixed into vLLM's worker by ``--worker-extension-cls posttrain_vllm_ext.WeightReceiver``; ``self`` is the
    worker (``self.device``, ``self.reload_weights``). Called through ``/collective_rpc`` (see the module
    docstring). Method names must not collide with the worker's own (vLLM asserts they do not)."""

    def weight_receiver_device(self) -> str:
        """The worker's device (``cpu``, ``cuda:0``…): the trainer picks the backend from it, and learns that
        the extension is there."""
        return str(self.device)

    def init_weight_group(self, host: str, port: int, rank: int, world: int, backend: str,
                          timeout_s: float = 600.0, name: str = "group") -> dict:
        """Join the trainer's weight group ``name`` (its TCPStore at ``host:port``) as ``rank`` of ``world``;
        replaces a group joined before (a trainer that restarted, or reconnected after an error)."""
        self.close_weight_group()
        store = torch.distributed.TCPStore(host, int(port), int(world), False,
                                           timeout=datetime.timedelta(seconds=float(timeout_s)))
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        store.set(f"joining/{name}", "1")
        group = open_group(store, int(rank), int(world), backend, local_address(host), float(timeout_s), name)
        self._posttrain_weights = {"store": store, "group": group, "backend": backend, "name": name}
        return {"device": str(self.device), "backend": backend}

    def receive_weights(self, group: str, sync: int, layout: str) -> dict:
        """Receive the tensors ``layout`` (JSON, buckets of ``[name, dtype, shape]``) names, broadcast by rank 0 of
        weight group ``group`` bucket by bucket, and reload them into the model in place; returns
        ``{"tensors", "bytes"}``. Raises ``LookupError`` (``STALE``) at once when this worker is not in ``group``
        (it joined another trainer's since, or none), so the trainer sets up a new one."""
        state = getattr(self, "_posttrain_weights", None)
        if state is None or state["name"] != group:
            raise LookupError(f"{STALE} {group!r}: join it again with init_weight_group")
        device = self.device if state["backend"] == "nccl" else torch.device("cpu")
        buckets = json.loads(layout)
        for bucket in buckets:
            bucket_bytes(bucket)  # an unknown dtype fails here, before the trainer starts sending
        received = _Received(state["group"], buckets, device)
        state["store"].set(f"ready/{int(sync)}", "1")
        try:
            self.reload_weights(weights_iterator=iter(received), is_checkpoint_format=True)
        finally:
            received.drain()
        return {"tensors": received.tensors, "bytes": received.bytes}

    def close_weight_group(self) -> None:
        state = getattr(self, "_posttrain_weights", None)
        self._posttrain_weights = None
        if state is not None:
            try:
                state["group"].shutdown()
            except Exception:  # noqa: BLE001 - best effort: the peer may be gone
                pass


def install(directory: str) -> str:
    """Copy this file to ``directory/posttrain_vllm_ext.py`` (the engine imports it under that name, so nothing
    else of posttrain's is on its path); returns ``directory``."""
    import os
    import shutil

    os.makedirs(directory, exist_ok=True)
    shutil.copyfile(__file__, os.path.join(directory, f"{MODULE}.py"))
    return directory


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(f"usage: python -m posttrain.generate.vllm_worker_ext DIR\n(copies {MODULE}.py into DIR for an "
                 "engine you start yourself with rollout.sync_method=broadcast)")
    target = install(sys.argv[1])
    print(f"start vLLM with: PYTHONPATH={target} VLLM_SERVER_DEV_MODE=1 vllm serve … "
          f"--worker-extension-cls {EXTENSION_CLS}")
