"""Background checkpoint uploads to a remote run store, one in flight, manifest last.

The loop saves a checkpoint to local disk (DCP at disk speed, the step blocks only for that) and hands it
to ``CheckpointUploader.submit``; a thread on every rank uploads the files that rank wrote (its DCP shards
``__<rank>_*.distcp`` and ``rng-rank<rank>.json``; rank 0 also ``.metadata`` and ``trainer.json``), checks
each one's size in the store, and leaves a marker ``.uploaded-rank<r>-<attempt>``. Rank 0 waits for every
rank's marker, removes the markers, then writes ``manifest.json`` — the commit —, prunes old checkpoints
and uploads the logs. No collective runs in the thread, so training goes on while it uploads; a new save
first waits for the previous upload (``wait``), so at most one is in flight.

When the store keeps failing past ``store.max_outage_s`` (``RunStore.call`` retries with backoff until
then) the upload is abandoned: its step has no manifest, so the previous checkpoint stays the newest valid
one, an alert is raised, and ``down`` tells the loop to stop with exit 75 (resumable).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from posttrain.store.run_store import CHECKPOINTS, MANIFEST, RunStore, StoreUnavailable


class CheckpointUploader:
    def __init__(self, store: RunStore, rank: int, world: int, keep_last: int, attempt: str,
                 alert: Callable[..., None], on_commit: Callable[[int, float, float], None] | None = None):
        self.store, self.rank, self.world, self.keep_last, self.attempt = store, rank, world, keep_last, attempt
        self.alert, self.on_commit = alert, on_commit
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    @property
    def down(self) -> bool:
        """The store stayed unavailable past the outage limit: the run should stop (exit 75)."""
        return isinstance(self.failure, StoreUnavailable)

    def submit(self, step: int, local_dir: Path, files: list[str], local_s: float = 0.0) -> float:
        """Start uploading checkpoint ``step`` (``files``: the names this rank wrote; ``local_s``: how long its
        local save took, added to the upload time reported at the commit); returns the seconds spent waiting
        for the previous upload first."""
        waited = self.wait()
        if self.down:
            return waited
        self._thread = threading.Thread(target=self._upload, args=(step, local_dir, files, local_s),
                                        name=f"posttrain-upload-{step}", daemon=True)
        self._thread.start()
        return waited

    def wait(self) -> float:
        """Block until the upload in flight (if any) has finished; re-raise a failure that is not an outage."""
        started = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.failure is not None and not self.down:
            failure, self.failure = self.failure, None
            raise failure
        return time.perf_counter() - started

    def _upload(self, step: int, local_dir: Path, files: list[str], local_s: float) -> None:
        base = f"{CHECKPOINTS}/step-{step:06d}"
        t0 = time.perf_counter()
        try:
            for name in sorted(files):
                if name != MANIFEST:
                    self.store.put_file(local_dir / name, f"{base}/{name}")
            self.store.write_bytes(self._marker(base, self.rank), b"")
            if self.rank == 0:
                self._commit(step, base, local_dir)
                seconds = time.perf_counter() - t0
                if self.on_commit is not None:
                    self.on_commit(step, local_s + seconds, time.time())
                self.alert("checkpoint_uploaded", step=step, seconds=round(seconds, 3), store=self.store.url,
                           echo=False)
        except StoreUnavailable as exc:
            self.failure = exc
            self.alert("store_unavailable", step=step, error=str(exc), rank=self.rank,
                       message=f"checkpoint {step} could not be uploaded to {self.store.url}: {exc}. The previous "
                       "checkpoint stays the newest valid one; stopping with exit 75 (rerun to resume)")
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which re-raises it (wait)
            self.failure = exc

    def _marker(self, base: str, rank: int) -> str:
        return f"{base}/.uploaded-rank{rank}-{self.attempt}"

    def _commit(self, step: int, base: str, local_dir: Path) -> None:
        """Rank 0: every rank's files are up → the manifest (the commit), then clean-up and the logs."""
        deadline = time.monotonic() + self.store.max_outage_s
        waiting = set(range(self.world))
        while waiting:
            waiting = {rank for rank in waiting if not self.store.exists(self._marker(base, rank))}
            if waiting and time.monotonic() > deadline:
                raise StoreUnavailable(f"ranks {sorted(waiting)} did not finish uploading checkpoint {step} within "
                                       f"store.max_outage_s={self.store.max_outage_s:g} s")
            if waiting:
                time.sleep(0.2)
        # The markers go before the commit: once rank 0 has seen them all nothing reads them, and removed
        # first they never outlive a process killed between the manifest and the clean-up. Every attempt's go:
        # a crashed attempt that reached this step left its own in the directory this attempt reuses.
        for name in self.store.listdir(base):
            if name.startswith(".uploaded-"):
                self.store.remove(f"{base}/{name}")
        self.store.put_file(local_dir / MANIFEST, f"{base}/{MANIFEST}")
        self.store.after_commit(step, self.keep_last)

