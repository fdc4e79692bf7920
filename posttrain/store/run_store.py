"""``RunStore``: a run's files at a URL, mirrored in a local directory (see ``posttrain.store``).

Every remote operation goes through ``RunStore.call``: a failure (a 5xx, a dropped connection, a timeout,
an upload whose size does not match) is retried with exponential backoff — ``store.backoff_s`` doubling up
to 30 s — until it succeeds or the store has been failing for ``store.max_outage_s`` seconds, when
``StoreUnavailable`` is raised. Callers decide what that means (the uploader: alert and exit 75).

Checkpoint validity on a store without atomic rename is the manifest: ``manifest.json`` is written last and
lists every file with its sha256 and size. A step directory without a manifest, with a malformed one, with a
file missing, of the wrong size or not listed, is not a checkpoint; a fetched file whose sha256 differs makes
the checkpoint invalid too, and the next older one is tried. Names from a manifest are checked to stay
inside the step directory before anything is written (``posttrain.store.manifest``), and with
``store.signing_key`` a manifest without its signature stops the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.cache import cache_dir
from posttrain.data.storage import filesystem, is_remote, protocol_of, sha256_file
from posttrain.store.manifest import (
    MANIFEST,
    UNSIGNED,
    UPLOAD_MARKER_PREFIX,
    CheckpointTrust,
    ManifestError,
    member_path,
    parse_manifest,
)

CHECKPOINTS = "checkpoints"
# What comes down at start (small) — the logs continue where the remote ones end, cut to the resume step.
# Logs go up with each committed checkpoint; at start they come down with the other small files.
LOGS = ("metrics.jsonl", "alerts.jsonl", "units.jsonl", "config.yaml")
SMALL_FILES = ("finished.json", *LOGS, "eval.json")
MAX_BACKOFF_S = 30.0
# Errors that retrying cannot fix (bugs); a missing bucket and bad credentials are reported with the URL.
PERMANENT = (ImportError, TypeError, AttributeError, KeyError)


class StoreUnavailable(OSError):
    """The store kept failing for ``store.max_outage_s`` seconds."""


class IncompleteUpload(OSError):
    """An uploaded object is missing or has another size than the local file (a dropped or cut write)."""


def working_dir(output_dir: str, local_dir: str | Path | None = None) -> Path:
    """Where a run with this ``output_dir`` writes: the directory itself, or a remote one's local mirror."""
    if not is_remote(output_dir):
        return Path(str(output_dir).removeprefix("file://"))
    return Path(local_dir) if local_dir else default_local_dir(str(output_dir).rstrip("/"))


def default_local_dir(url: str) -> Path:
    """``$XDG_CACHE_HOME/posttrain/runs/<readable name>-<hash>``: one local mirror per remote URL."""
    base = cache_dir("runs")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", url.split("://", 1)[-1]).strip("-")[-60:]
    return base / f"{readable}-{hashlib.sha256(url.encode()).hexdigest()[:10]}"


def _open_fs(url: str):
    options: dict[str, Any] = {}
    if protocol_of(url) in ("s3", "s3a"):
        # RunStore.call retries with backoff up to store.max_outage_s; s3fs's and botocore's own retry loops
        # (5 × 5 attempts by default) would make one call last minutes and the limit meaningless.
        options = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"},
                                     "connect_timeout": 10, "read_timeout": 120}}
    # Listings are never cached: other processes (other ranks, a crashed attempt) write to the same prefix.
    fs, root = filesystem(url, skip_instance_cache=True, use_listings_cache=False, **options)
    if hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own retry loop (a class attribute, not a constructor option)
    return fs, root


class RunStore:
    """A run's directory at ``url``; ``local`` is where the run writes (the same directory when local)."""

    def __init__(self, url: str, local_dir: str | Path | None = None, backoff_s: float = 1.0,
                 max_outage_s: float = 600.0, on_retry: Callable[[str, BaseException], None] | None = None,
                 trust: CheckpointTrust = UNSIGNED):
        self.url = str(url).rstrip("/")
        self.trust = trust  # what a checkpoint is checked against: store.signing_key, train.max_steps
        self.skipped: list[tuple[str, str]] = []  # checkpoints passed over at the last fetch_latest, and why
        self.remote = is_remote(self.url)
        self.backoff_s, self.max_outage_s = backoff_s, max_outage_s
        self.on_retry = on_retry
        self.local = working_dir(self.url, local_dir)
        if self.remote:
            self.fs, self.root = _open_fs(self.url)
        else:
            self.fs, self.root = None, str(self.local)

    def __repr__(self) -> str:
        return f"RunStore({self.url!r}, local={str(self.local)!r})"

    # -- remote primitives, each retried -------------------------------------------------------------
    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, retried with exponential backoff until it succeeds or the outage limit passes."""
        first_failure: float | None = None
        delay = self.backoff_s
        while True:
            try:
                return fn(*args)
            except (FileNotFoundError, PermissionError) as exc:  # a missing bucket, bad credentials: no retrying
                raise type(exc)(f"{what} on {self.url}: {exc}") from exc
            except PERMANENT:
                raise
            except Exception as exc:  # noqa: BLE001 - 5xx, resets, timeouts: botocore and aiohttp raise many kinds
                now = time.monotonic()
                if first_failure is None:
                    first_failure = now
                    if self.on_retry is not None:  # once per failing call, not once per attempt
                        self.on_retry(what, exc)
                if now - first_failure + delay > self.max_outage_s:
                    raise StoreUnavailable(f"{what} on {self.url} kept failing for {now - first_failure:.0f} s "
                                           f"(store.max_outage_s={self.max_outage_s:g}): {exc}") from exc
                time.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)

    def exists(self, rel: str) -> bool:
        return bool(self.call(f"checking {rel}", self.fs.exists, self.path(rel)))

    def size(self, rel: str) -> int | None:
        def info():
            try:
                return int(self.fs.info(self.path(rel))["size"])
            except FileNotFoundError:
                return None

        return self.call(f"reading the size of {rel}", info)

    def read_bytes(self, rel: str) -> bytes | None:
        def cat():
            try:
                return self.fs.cat_file(self.path(rel))
            except FileNotFoundError:
                return None

        return self.call(f"reading {rel}", cat)

    def write_bytes(self, rel: str, data: bytes) -> None:
        def pipe():
            self.fs.pipe_file(self.path(rel), data)
            self._check_size(rel, len(data))

        self.call(f"writing {rel}", pipe)

    def put_file(self, local_path: Path, rel: str) -> None:
        """Upload one file and check that the store holds all of it (a write can be dropped silently —
        pytorch#183878 is one such case — so success is the size the store reports, not the call returning)."""
        expected = local_path.stat().st_size

        def put():
            self.fs.put_file(str(local_path), self.path(rel))
            self._check_size(rel, expected)

        self.call(f"uploading {rel}", put)

    def _check_size(self, rel: str, expected: int) -> None:
        try:
            stored = int(self.fs.info(self.path(rel))["size"])
        except FileNotFoundError:
            stored = None
        if stored != expected:
            raise IncompleteUpload(f"{rel}: the store holds {stored if stored is not None else 'nothing'} "
                                   f"of {expected} bytes after the upload")

    def get_file(self, rel: str, local_path: Path) -> None:
        local_path.parent.mkdir(parents=True, exist_ok=True)
        self.call(f"downloading {rel}", self.fs.get_file, self.path(rel), str(local_path))

    def listdir(self, rel: str) -> list[str]:
        def ls():
            try:
                return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.path(rel), detail=False)]
            except FileNotFoundError:
                return []

        return self.call(f"listing {rel or '/'}", ls)

    def remove(self, rel: str) -> None:
        def rm():
            try:
                self.fs.rm(self.path(rel), recursive=True)
            except FileNotFoundError:
                pass

        self.call(f"removing {rel}", rm)

    # -- run files ------------------------------------------------------------------------------------
    def push(self, names: tuple[str, ...] | list[str]) -> None:
        """Upload these files or directories (relative to the run) that exist locally; a no-op when local."""
        if not self.remote:
            return
        for name in names:
            source = self.local / name
            if source.is_dir():
                for file in sorted(p for p in source.rglob("*") if p.is_file()):
                    self.put_file(file, str(file.relative_to(self.local)))
            elif source.is_file():
                self.put_file(source, name)

    def pull_small_files(self) -> None:
        """Make the local mirror's small files those of the store (a stale local copy is removed)."""
        for name in SMALL_FILES:
            local = self.local / name
            data = self.read_bytes(name)
            if data is None:
                local.unlink(missing_ok=True)
            else:
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_bytes(data)

    # -- checkpoints ----------------------------------------------------------------------------------
    def checkpoint_steps(self) -> list[int]:
        """Every ``step-N`` directory in the store, newest first (committed or not)."""
        steps = []
        for name in self.listdir(CHECKPOINTS):
            match = re.fullmatch(r"step-(\d+)", name)
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps, reverse=True)

    def manifest(self, step: int) -> tuple[dict[str, Any] | None, str]:
        """``(manifest, "")`` when step ``step`` is committed and every file is there in full, else ``(None, why)``."""
        base = f"{CHECKPOINTS}/step-{step:06d}"
        data = self.read_bytes(f"{base}/{MANIFEST}")
        if data is None:
            return None, "no manifest (the upload did not finish)"
        try:  # a signature problem is raised: the store holds checkpoints this run's key did not sign
            manifest = parse_manifest(data, key=self.trust.key, step=step, where=f"{self.url}/{base}")
        except ManifestError as exc:
            return None, str(exc)
        files, sizes = manifest["files"], manifest.get("sizes", {})
        unsized = sorted(set(files) - set(sizes))
        if unsized:  # a remote checkpoint's sizes bound what a resume downloads
            return None, f"manifest gives no size for {unsized[0]}"
        # Only top-level files: posttrain's checkpoints have no subdirectories, so any other entry is foreign.
        unlisted = [name for name in self.listdir(base)
                    if name != MANIFEST and not name.startswith(UPLOAD_MARKER_PREFIX) and name not in files]
        if unlisted:
            return None, f"file {unlisted[0]} is not in the manifest"
        for name in files:
            stored = self.size(f"{base}/{name}")
            if stored is None:
                return None, f"file {name} missing"
            if stored != sizes[name]:
                return None, f"file {name} has {stored} of {sizes[name]} bytes"
        return manifest, ""

    def fetch_checkpoint(self, step: int, manifest: dict[str, Any]) -> Path:
        """Download step ``step`` into ``local/checkpoints/step-N`` (files already there with the right sha256
        are kept), verify every size and sha256 and the small files a load reads first, write the manifest last;
        raise ``ValueError`` (``ManifestError``) when anything does not match. ``manifest`` comes from
        ``manifest()``: its names were checked, and every target is checked again to stay in the mirror."""
        from posttrain.train.checkpoint import check_small_files  # the train side of the same checks

        root = self.local / CHECKPOINTS
        final, staging = root / f"step-{step:06d}", root / f"step-{step:06d}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        sizes = manifest.get("sizes", {})
        try:
            targets = {name: (member_path(staging, name), member_path(final, name)) for name in manifest["files"]}
            for name, expected in manifest["files"].items():
                target, cached = targets[name]
                if cached.is_file() and not cached.is_symlink() and sha256_file(cached) == expected:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(cached, target)
                    continue
                self.get_file(f"{CHECKPOINTS}/step-{step:06d}/{name}", target)
                if name in sizes and target.stat().st_size != sizes[name]:
                    raise ManifestError(f"file {name} came down with {target.stat().st_size} of {sizes[name]} bytes")
                if sha256_file(target) != expected:
                    raise ManifestError(f"checksum mismatch in {name}")
            check_small_files(staging, manifest, step, self.trust.max_step)
        except ManifestError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        return final

    def sync_down(self) -> tuple[int, dict[str, Any]] | None:
        """Start of a run on a remote store (the local mirror's main process): small files come down, the
        newest valid checkpoint is fetched, stale local checkpoints and exports go. Returns the fetched
        ``(step, manifest)``, verified: no need to hash it again."""
        self.local.mkdir(parents=True, exist_ok=True)
        self.pull_small_files()
        for name in ("final", "adapter"):
            shutil.rmtree(self.local / name, ignore_errors=True)
        return self.fetch_latest()

    def fetch_latest(self) -> tuple[int, dict[str, Any]] | None:
        """Fetch the newest valid checkpoint into the mirror (an invalid one is reported and skipped) and drop
        every other local checkpoint. Returns its ``(step, manifest)``, or None when the store holds none."""
        fetched = None
        self.skipped = []
        for step in self.checkpoint_steps():
            manifest, problem = self.manifest(step)
            if manifest is not None:
                try:
                    self.fetch_checkpoint(step, manifest)
                    fetched = (step, manifest)
                    break
                except ValueError as exc:
                    problem = str(exc)
            where = f"{self.url}/{CHECKPOINTS}/step-{step:06d}"
            warnings.warn(f"skipping checkpoint {where}: {problem}", stacklevel=2)
            self.skipped.append((where, problem))
        root = self.local / CHECKPOINTS
        if root.exists():
            for child in root.iterdir():
                if fetched is None or child.name != f"step-{fetched[0]:06d}":
                    shutil.rmtree(child, ignore_errors=True)
        return fetched

    def prune(self, keep_last: int, committed: int) -> None:
        """After ``committed`` was committed: keep the newest ``keep_last`` committed checkpoints; remove older
        ones and every uncommitted step directory but the committed one's (failed uploads, a crashed attempt)."""
        kept = 0
        for step in self.checkpoint_steps():
            committed_here = self.exists(f"{CHECKPOINTS}/step-{step:06d}/{MANIFEST}")
            if committed_here and kept < keep_last and step <= committed:
                kept += 1
                continue
            if step == committed or (committed_here and step > committed):
                continue
            self.remove(f"{CHECKPOINTS}/step-{step:06d}")

    def after_commit(self, step: int, keep_last: int) -> None:
        """Once checkpoint ``step`` is committed (rank 0): prune old checkpoints and upload the logs."""
        self.prune(keep_last, step)
        self.push(LOGS)

    def move_previous(self) -> str | None:
        """``train.resume=never`` on a remote store: move the previous run under ``previous-<UTC time>/``."""
        # The run's lease (posttrain.store.lock) stays: it is this run's, held while it moves the old one aside.
        present = [name for name in self.listdir("") if not name.startswith(("previous-", ".posttrain-"))]
        if not present:
            return None
        target = time.strftime("previous-%Y%m%dT%H%M%SZ", time.gmtime())
        for name in present:
            # Object by object: a store has no directories to move (s3fs's recursive mv trips over the prefix).
            for file in self.call(f"listing {name}", self.fs.find, self.path(name)):
                relative = file[len(self.root) + 1:]
                self.call(f"moving {relative}", self.fs.copy, file, self.path(f"{target}/{relative}"))
            self.remove(name)
        return f"{self.url}/{target}"

    def clear_local(self) -> None:
        if self.remote and self.local.exists():
            shutil.rmtree(self.local)
        self.local.mkdir(parents=True, exist_ok=True)
