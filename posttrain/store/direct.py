"""``store.upload=direct``: DCP writes each rank's shards straight into the remote store through its fsspec
writer — for nodes whose local disk cannot hold a checkpoint — and nothing is committed unverified.

torch 2.13's ``FsspecWriter`` trusts the stream: it fsyncs a file descriptor a remote file does not have
(falling back to ``os.sync``, which knows nothing of fsspec's buffers; pytorch#183878) and reports success
whether the bytes reached the store or not. Here every stream DCP opens is wrapped: it hashes and counts
what DCP writes, is **flushed before it is closed**, and the writer records ``(sha256, size)`` per file.
After the save, rank 0 compares the size the store reports for every file of every rank with the bytes
written; only then does it write the manifest (the commit). A dropped or cut shard leaves the step without
a manifest — never loaded — and the run goes on (``checkpoint_incomplete`` alert), as with a failed
background upload.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from posttrain import dist
from posttrain.store.run_store import CHECKPOINTS, MANIFEST, MAX_BACKOFF_S, RunStore, StoreUnavailable
from posttrain.train.checkpoint import (
    TRAINER_STATE,
    _only,
    build_manifest,
    rng_file_name,
    rng_state_bytes,
    trainable_keys,
)


class _CountingStream(io.RawIOBase):
    """Wraps a remote file: every byte written is hashed and counted; ``close`` flushes first."""

    def __init__(self, raw, on_close):
        self.raw, self.on_close = raw, on_close
        self.digest, self.size = hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += view.nbytes
        self.raw.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.raw.flush()  # the bytes reach the store before close (pytorch#183878)
            self.raw.close()
            self.on_close(self.digest.hexdigest(), self.size)
        super().close()


class _RecordingFileSystem(FileSystem):
    """DCP's fsspec filesystem on the store's own fsspec instance, recording what each stream wrote."""

    def __init__(self, fs, written: dict[str, tuple[str, int]]):
        super().__init__()
        self.fs, self.written = fs, written

    def init_path(self, path, **kwargs):  # noqa: ARG002 - the store's filesystem (and its retry settings)
        return path

    @contextmanager
    def create_stream(self, path, mode: str):
        path = os.fspath(path)
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = path.rsplit("/", 1)[-1]
        raw = self.fs.open(path, mode)
        stream = _CountingStream(raw, lambda sha, size: self.written.__setitem__(name, (sha, size)))
        try:
            yield stream
        except BaseException:
            raw.close()
            try:
                self.fs.rm(path)
            except OSError:
                pass
            raise
        stream.close()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        old, new = os.fspath(path).rsplit("/", 1)[-1], os.fspath(new_path).rsplit("/", 1)[-1]
        if old in self.written:
            self.written[new] = self.written.pop(old)


class VerifiedFsspecWriter(FsspecWriter):
    """``FsspecWriter`` whose streams are flushed before close and whose files are hashed as written."""

    def __init__(self, fs, path: str):
        super().__init__(path, sync_files=False)  # os.sync is no guarantee for a remote file; the size check is
        self.written: dict[str, tuple[str, int]] = {}
        self.fs = _RecordingFileSystem(fs, self.written)
        self.path = path


def save_direct(store: RunStore, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                trainer_state: dict[str, Any], identity: dict[str, Any]) -> str:
    """Save checkpoint ``step`` straight into the store (a collective). Returns ``""`` when it was committed,
    else why not (a file that did not reach the store in full: no manifest was written). A store that stays
    down raises ``StoreUnavailable`` on every rank."""
    base = f"{CHECKPOINTS}/step-{step:06d}"
    # A store outage on one rank must reach every rank through the collectives below, not leave them waiting.
    outage = _outage(lambda: store.remove(f"{base}/{MANIFEST}")) if dist.is_main() else None  # no old commit
    trainable = trainable_keys(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    writer = _dcp_save_with_retries(store, base, {"model": _only(model_sd, trainable), "optim": optim_sd})
    mine = dict(writer.written)
    blobs = {rng_file_name(dist.rank()): rng_state_bytes()}
    if dist.is_main():
        blobs[TRAINER_STATE] = json.dumps(trainer_state, sort_keys=True).encode()
    for name, data in blobs.items():
        outage = outage or _outage(lambda name=name, data=data: store.write_bytes(f"{base}/{name}", data))
        mine[name] = (hashlib.sha256(data).hexdigest(), len(data))
    everyone = dist.gather_objects((mine, outage))
    outage = next((failure for _, failure in everyone if failure is not None), None)
    problem = ""
    if dist.is_main() and outage is None:
        merged = {name: entry for files, _ in everyone for name, entry in files.items()}
        try:
            problem = _verify_and_commit(store, base, step, identity, merged, trainable)
        except StoreUnavailable as exc:
            outage = exc
    problem, outage = dist.broadcast_object((problem, outage))
    if outage is not None:
        raise outage
    return problem


def _dcp_save_with_retries(store: RunStore, base: str, state: dict[str, Any]) -> VerifiedFsspecWriter:
    """``dcp.save`` into the store, the whole save retried with backoff while the store fails (DCP's own writes
    do not go through ``RunStore.call``), up to ``store.max_outage_s``. DCP raises a failure on every rank, and
    rank 0 decides whether to try again, so every rank does the same."""
    started, delay = time.monotonic(), store.backoff_s
    while True:
        writer = VerifiedFsspecWriter(store.fs, store.path(base))
        try:
            dcp.save(state, storage_writer=writer, no_dist=not dist.initialized())
            return writer
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps the writers' errors
            failure = exc
        give_up = dist.broadcast_object(time.monotonic() - started + delay > store.max_outage_s)
        if give_up:
            raise StoreUnavailable(f"writing checkpoint {base} to {store.url} kept failing for "
                                   f"{time.monotonic() - started:.0f} s (store.max_outage_s={store.max_outage_s:g}): "
                                   f"{str(failure)[:300]}") from failure
        if store.on_retry is not None:
            store.on_retry(f"writing {base}", failure)
        time.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)


def _outage(action) -> StoreUnavailable | None:
    """Run ``action``; the ``StoreUnavailable`` it raised, or None."""
    try:
        action()
    except StoreUnavailable as exc:
        return exc
    return None


def _verify_and_commit(store: RunStore, base: str, step: int, identity: dict[str, Any],
                       files: dict[str, tuple[str, int]], trainable) -> str:
    """Rank 0: every file in the store in full → write the manifest (the commit); else say which is not."""
    for name, (_, size) in sorted(files.items()):
        stored = store.size(f"{base}/{name}")
        if stored != size:
            return f"{name}: the store holds {stored if stored is not None else 'nothing'} of {size} bytes"
    manifest = build_manifest(step, identity, files, trainable, store.trust.key)
    store.write_bytes(f"{base}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
    return ""


class DirectSaver:
    """The loop's checkpoint path for ``store.upload=direct``: save into the store, alert on an incomplete
    checkpoint (the run goes on; the previous one stays the newest valid), prune and upload the logs after a
    commit, and say ``down`` once the store stayed unavailable past ``store.max_outage_s``."""

    def __init__(self, store: RunStore, keep_last: int, alert):
        self.store, self.keep_last, self.alert = store, keep_last, alert
        self.down = False

    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any], identity: dict[str, Any]) -> bool:
        started = time.perf_counter()
        try:
            problem = save_direct(self.store, step, model, optimizer, trainer_state, identity)
        except StoreUnavailable as exc:
            self.down = True
            self.alert("store_unavailable", step=step, error=str(exc), rank=dist.rank(),
                       message=f"checkpoint {step} could not be written to {self.store.url}: {exc}")
            return False
        if problem:
            self.alert("checkpoint_incomplete", step=step, problem=problem,
                       message=f"checkpoint {step} did not reach {self.store.url} in full ({problem}); it was not "
                       "committed — the previous checkpoint stays the newest valid one, training goes on")
            return False
        if dist.is_main():
            seconds = time.perf_counter() - started
            try:
                self.store.after_commit(step, self.keep_last)
            except StoreUnavailable as exc:  # the checkpoint is committed; the next save retries the clean-up
                self.alert("store_retry", what="pruning and uploading logs", error=str(exc)[:300])
            self.alert("checkpoint_uploaded", step=step, seconds=round(seconds, 3), store=self.store.url,
                       echo=False)
        return True
