"""Where record files live: local paths and object-store URLs (``s3://``, ``gs://``, … through fsspec).

Three things every reader and writer of ``posttrain.data.io`` needs from a URL, in one place:

- **a filesystem, or a clear error** (``filesystem``): ``s3://`` needs ``s3fs`` (``pip install
  'posttrain[s3]'``), ``gs://`` needs ``gcsfs``; without the package the error names the URL and the fix
  (``StorageUnavailable``, exit 2) instead of fsspec's bare ``ImportError``.
- **one-line errors** (``storage_errors``): missing credentials or an unreachable endpoint are the machine's
  problem (``StorageAccessError``, exit 1); a missing bucket or key is a bad path (``FileNotFoundError``,
  exit 2); a refused access is ``PermissionError`` (exit 2). Each message names the URL and what to set.
- **all-or-nothing writes** (``AtomicFile``): a reader never sees half a file. On local disk the bytes go to
  a temporary name that is renamed into place; on an object store to a temporary key beside the target
  that is moved (a server-side copy) onto it once complete, and whose size is checked against the bytes
  written. A failed write removes its temporary file or key; a killed writer may leave a
  ``….tmp-<id>`` key, which no reader picks up (the suffix is not a record suffix), and the next commit of
  the same target removes every such leftover older than ``STALE_TEMP_S`` (younger ones may be another
  writer's, still under way). Writing into a bucket
  that does not exist is refused: s3fs would silently create it, and a typo would then hold the data.

``file_fingerprint`` / ``source_fingerprint`` identify data for the run identity
(``posttrain.train.identity``); see ``file_fingerprint`` for why an ETag is a safe change detector.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from posttrain.cache import stat_cached_digest

# Packages that give fsspec a protocol, and how to install them (the extras of pyproject.toml).
_PROTOCOL_PACKAGES = {"s3": ("s3fs", "pip install 'posttrain[s3]'"), "s3a": ("s3fs", "pip install 'posttrain[s3]'"),
                      "gs": ("gcsfs", "pip install gcsfs"), "gcs": ("gcsfs", "pip install gcsfs"),
                      "az": ("adlfs", "pip install adlfs"), "abfs": ("adlfs", "pip install adlfs")}
# Protocols whose first path component is a bucket (or container) that must exist before a write.
_BUCKET_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs")
_CREDENTIALS_HELP = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or run where an instance role "
          "applies); AWS_ENDPOINT_URL points at an S3-compatible store",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or run `gcloud auth "
          "application-default login`",
}
FINGERPRINT_FILES_KEPT = 1000  # a source of more files keeps only its overall digest (manifests stay small)


class StorageUnavailable(RuntimeError):
    """A URL's protocol needs a package that is not installed; the message names the URL and the install."""


class StorageAccessError(RuntimeError):
    """The store could not be reached or would not authenticate us (the machine's setup, not the input)."""


def protocol_of(url: str) -> str:
    """``"s3"`` for ``s3://b/k``, ``"file"`` for a local path."""
    url = str(url)
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def is_remote(url: str) -> bool:
    return protocol_of(url) not in ("file", "local")


def is_plain_local(url: str) -> bool:
    """A local path that the standard library handles as fsspec would: no protocol (``file://``, chained ``::``)
    and no ``~`` (fsspec expands it). fsspec is imported only for other URLs: with asyncio, its import is 0.07 s of
    every ``posttrain curate`` of a local file, which needs none of it."""
    url = str(url)
    return "://" not in url and "::" not in url and not url.startswith("~")


def _path_test(url: str, name: str) -> bool:
    """``os.path.<name>(url)`` for a plain local path (no fsspec import), else the filesystem's ``<name>``."""
    if is_plain_local(url):
        return getattr(os.path, name)(url)
    fs, path = filesystem(url)
    with storage_errors(str(url)):
        return getattr(fs, name)(path)


def path_exists(url: str) -> bool:
    """Whether a file or directory is at ``url``."""
    return _path_test(url, "exists")


def path_isdir(url: str) -> bool:
    """Whether ``url`` is a directory."""
    return _path_test(url, "isdir")


def filesystem(url: str, **options: Any) -> tuple[Any, str]:
    """``(fs, path)`` of ``url`` (``options`` go to the filesystem), with ``StorageUnavailable`` naming the
    package a protocol needs."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(str(url), **options)
    except ImportError as exc:
        raise _unavailable(str(url), exc) from None


def _unavailable(url: str, exc: ImportError) -> StorageUnavailable:
    protocol = protocol_of(url)
    package, install = _PROTOCOL_PACKAGES.get(protocol, (None, None))
    if package is None:
        return StorageUnavailable(f"{url}: reading {protocol}:// URLs needs a package fsspec names: {exc}")
    return StorageUnavailable(f"{url}: {protocol}:// URLs need {package}, which is not installed: {install}")


def _botocore_errors() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(credential errors, connection errors) of botocore, when it is installed (it comes with s3fs)."""
    try:
        from botocore import exceptions
    except ImportError:
        return (), ()
    return ((exceptions.NoCredentialsError, exceptions.PartialCredentialsError, exceptions.NoRegionError),
            (exceptions.EndpointConnectionError, exceptions.ConnectTimeoutError, exceptions.ReadTimeoutError))


def _endpoint() -> str:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f" (endpoint {endpoint}, from AWS_ENDPOINT_URL)" if endpoint else ""


@contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Turn an object store's failures into one-line errors that name ``url`` (see the module docstring)."""
    if not is_remote(url):
        yield
        return
    credentials, connection = _botocore_errors()
    protocol = "s3" if protocol_of(url).startswith("s3") else protocol_of(url)
    try:
        yield
    except ImportError as exc:
        raise _unavailable(url, exc) from None
    except credentials as exc:
        help_text = _CREDENTIALS_HELP.get(protocol, "configure the store's credentials")
        raise StorageAccessError(f"{url}: no usable credentials for {protocol}:// ({exc}); {help_text}") from None
    except connection as exc:
        raise StorageAccessError(f"{url}: cannot reach the object store{_endpoint()}: {exc}; check the endpoint "
                                 "URL and the network") from None
    except FileNotFoundError as exc:
        if str(exc).startswith(url):  # ours (posttrain.data.shards / io): it already says what is missing
            raise
        if "bucket" in str(exc).lower():
            raise FileNotFoundError(f"{url}: the bucket {bucket_of(url)!r} does not exist{_endpoint()}") from None
        raise FileNotFoundError(f"{url}: no such file or directory") from None
    except PermissionError as exc:
        if str(exc).startswith(url):
            raise
        raise PermissionError(f"{url}: access denied ({exc}); check the credentials' permissions on "
                              f"{bucket_of(url)!r}") from None


def bucket_of(url: str) -> str:
    """The bucket (first path component) of an object-store URL."""
    return str(url).split("://", 1)[-1].split("/", 1)[0]


def check_bucket(url: str) -> None:
    """Refuse a write into a bucket that does not exist (s3fs would create it on the first write)."""
    if protocol_of(url) not in _BUCKET_PROTOCOLS:
        return
    fs, _ = filesystem(url)
    with storage_errors(url):
        exists = fs.exists(bucket_of(url))
    if not exists:
        raise FileNotFoundError(f"{url}: the bucket {bucket_of(url)!r} does not exist{_endpoint()}")


def not_found(url: str, what: str = "no such file or directory") -> FileNotFoundError:
    """The error for a path that is not there: the missing bucket when that is the reason, else ``what``."""
    try:
        check_bucket(url)
    except FileNotFoundError as exc:
        return exc
    return FileNotFoundError(f"{url}: {what}")


# ------------------------------------------------------------------------------------------ writing


class _CountingWriter(io.RawIOBase):
    """Passes bytes to ``target`` and counts them: the size the stored object must have."""

    def __init__(self, target):
        self.target, self.count = target, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.target.write(data)
        self.count += len(data)
        return len(data)


STALE_TEMP_S = 3600.0  # a temporary file or key of a target this old is a killed writer's, not a slow one's


class AtomicFile:
    """A file written in full or not at all (see the module docstring). ``open()`` returns the handle
    (text for ``"w"``, bytes for ``"wb"``; compressed by ``compression``); ``commit()`` puts it in
    place, ``abort()`` throws it away. Also a context manager: commit on success, abort on an exception."""

    def __init__(self, url: str, mode: str = "wb", compression: str | None = None):
        if mode not in ("w", "wb"):
            raise ValueError(f"AtomicFile writes ('w' or 'wb'), not {mode!r}")
        self.url, self.mode, self.compression = str(url), mode, compression
        # A plain local path is written with the standard library (``fs`` None): the same steps, no fsspec import.
        self.fs, self.path = (None, os.path.abspath(self.url)) if is_plain_local(self.url) else filesystem(self.url)
        self.remote = is_remote(self.url)
        self.temp = f"{self.path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._raw = self._counter = self._handle = None

    def open(self):
        with storage_errors(self.url):
            if self.remote:
                check_bucket(self.url)
            else:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._raw = open(self.temp, "wb") if self.fs is None else self.fs.open(self.temp, "wb")  # noqa: SIM115
        self._counter = _CountingWriter(self._raw)
        stream: Any = self._counter
        if self.compression:
            from fsspec.compression import compr

            stream = compr[self.compression](stream, mode="wb")
        self._compressed = stream if self.compression else None
        self._handle = io.TextIOWrapper(io.BufferedWriter(stream) if not self.compression else stream,
                                        encoding="utf-8", newline="\n") if self.mode == "w" else stream
        return self._handle

    def _close_layers(self) -> None:
        if self.mode == "w":
            self._handle.flush()
            self._handle.detach()
        if self._compressed is not None:
            self._compressed.close()  # writes the trailer into the counter; leaves the raw file open
        self._raw.close()

    def commit(self) -> None:
        if self._raw is None:
            return
        try:
            with storage_errors(self.url):
                self._close_layers()
                if not self.remote:
                    os.replace(self.temp, self.path)
                else:
                    size = self.fs.info(self.temp)["size"]
                    if size != self._counter.count:
                        raise OSError(f"{self.url}: the upload holds {size} of {self._counter.count} bytes written")
                    self.fs.mv(self.temp, self.path)
                    self.fs.invalidate_cache(self.path)
        except BaseException:
            self._remove_temp()
            raise
        finally:
            self._raw = None
        self._sweep_stale_temps()

    def _sweep_stale_temps(self) -> None:
        """Remove the temporaries killed writers of this target left behind (best effort, see the module)."""
        try:
            now = time.time()
            parent, name = self.path.rsplit("/", 1) if "/" in self.path else ("", self.path)
            if self.fs is None:
                for path in glob.glob(f"{glob.escape(self.path)}.tmp-*"):
                    if now - os.path.getmtime(path) > STALE_TEMP_S:
                        os.remove(path)
                return
            if self.remote:  # one server-side prefix listing, not the whole directory of shards
                found = self.fs.find(parent, prefix=f"{name}.tmp-", detail=True).items()
            else:
                found = ((path, self.fs.info(path)) for path in self.fs.glob(f"{self.path}.tmp-*"))
            for path, info in found:
                modified = _modified_s(info)
                if modified is not None and now - modified > STALE_TEMP_S:
                    self.fs.rm(path)
        except Exception:  # noqa: BLE001 - a leftover is never read as data; failing to remove one is harmless
            pass

    def abort(self) -> None:
        if self._raw is None:
            return
        try:
            self._close_layers()
        except Exception:  # noqa: BLE001 - the write already failed; removing its leftovers is all that is left
            pass
        self._raw = None
        self._remove_temp()

    def _remove_temp(self) -> None:
        try:
            if self.fs is None:
                if os.path.exists(self.temp):
                    os.remove(self.temp)
            elif self.fs.exists(self.temp):
                self.fs.rm(self.temp)
        except Exception:  # noqa: BLE001 - best effort: a leftover temp key is never read as data
            pass

    def __enter__(self):
        return self.open()

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _modified_s(info: dict[str, Any]) -> float | None:
    """A file's or object's modification time (epoch seconds) from fsspec's ``info``: local ``mtime``, S3's
    ``LastModified`` (a datetime); None when the store gives neither."""
    value = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if value is None:
        return None
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


# ------------------------------------------------------------------------------------------ fingerprints


def sha256_file(path: str | os.PathLike, fs=None) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks: a local path, or ``path`` on fsspec filesystem ``fs``."""
    digest = hashlib.sha256()
    with (fs.open(path, "rb") if fs is not None else open(path, "rb")) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_fingerprint(fs, path: str, info: dict[str, Any] | None = None) -> str:
    """A string that changes whenever the file's content changes.

    - local files: ``sha256:<content hash>`` (the same rule as the model files' digest);
    - S3 (and S3-compatible stores): ``etag:<ETag>:<size>``, without reading the object. An ETag is not a
      content hash for multipart or KMS-encrypted uploads, but every write of an object gives it a new
      ETag computed from its bytes (single part: their MD5; multipart: the MD5 of the parts' MD5s) or a new
      opaque one, so changed content always means a changed ETag. The converse does not hold — the same
      bytes uploaded again with other part sizes get another ETag — which errs on the safe side: a resume is
      refused, never allowed on changed data. The version id and modification time are left out for the
      same reason (they change when identical bytes are uploaded again) and add no safety;
    - GCS: its ``md5Hash`` / ``crc32c`` content checksums when present;
    - any store that gives none of these: the content's sha256, read once.
    """
    if not is_remote(fs.unstrip_protocol(path)):  # read again only when its status changed (posttrain.cache)
        return f"sha256:{stat_cached_digest('sha256', [path], lambda: sha256_file(path, fs))}"
    info = info if info is not None else fs.info(path)
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return f"etag:{str(etag).strip(chr(34))}:{info.get('size')}"
    for key in ("md5Hash", "crc32c"):
        if info.get(key):
            return f"{key}:{info[key]}:{info.get('size')}"
    return f"sha256:{sha256_file(path, fs)}"


def source_fingerprint(url: str) -> dict[str, Any]:
    """``{"digest", "files", "per_file"}`` of a record source: a file, a shard set (directory or glob) or a
    saved HF dataset. ``digest`` covers every file's name (relative to the source) and fingerprint, so an
    added, removed, renamed or changed shard changes it; ``per_file`` (short digests by name, up to
    ``FINGERPRINT_FILES_KEPT`` files) lets a refusal say which ones changed."""
    from posttrain.data.shards import list_shards, shard_base

    url = str(url)
    with storage_errors(url):
        shards = list_shards(url)
        fs, _ = filesystem(url)
        base = shard_base(url)
        entries: dict[str, str] = {}
        for shard in shards:
            _, path = filesystem(shard)
            files = sorted(fs.find(path, detail=True).items()) if fs.isdir(path) else [(path, None)]
            for name, info in files:
                relative = os.path.relpath(name, base) if base else os.path.basename(name)
                entries[relative] = file_fingerprint(fs, name, info)
    digest = hashlib.sha256(json.dumps(sorted(entries.items())).encode()).hexdigest()
    per_file = ({name: hashlib.sha256(value.encode()).hexdigest()[:16] for name, value in entries.items()}
                if len(entries) <= FINGERPRINT_FILES_KEPT else None)
    return {"digest": digest, "files": len(entries), "per_file": per_file}
