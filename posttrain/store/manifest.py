"""A checkpoint's manifest, read as untrusted input: its shape, its file names, its signature, its files.

Whoever can write a run's directory or bucket prefix can write a manifest, and runs resume on their own
(exit 75 → restart) from stores that many jobs share. So before any file of a checkpoint is read:

- the manifest is a JSON object of the expected shape (``parse_manifest``): ``step`` and ``world_size`` are
  non-negative integers, ``files`` maps names to sha256 hex digests and ``sizes`` the same names to byte
  counts; anything else (a list, a string digest of the wrong length, a negative size) makes the checkpoint
  invalid, and the reader falls back to the previous one;
- every name is a plain relative path that stays inside the step directory (``member_name``): no absolute
  path, no ``..``, no empty or ``.`` part, no backslash or NUL — refused before a byte is written or read;
- with ``store.signing_key`` the manifest carries ``signature``, an HMAC-SHA256 over the rest of it
  (canonical JSON); a missing or wrong signature raises ``CheckpointSignatureError`` (exit 2), since it means
  the store holds checkpoints this key did not write;
- on local disk, the step directory holds exactly the listed files, each a regular file (no symlink, device or
  FIFO: a manifest entry pointing at ``/dev/zero`` would hash forever) of the listed size, then of the listed
  sha256 (``verify_files``). An unlisted file is an error, not ignored.

The signing key is never in a config file: ``store.signing_key`` names where it is — ``env:VAR`` (an
environment variable, e.g. from a Kubernetes Secret's ``secretKeyRef``) or ``file:/path`` (a mounted Secret).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data.storage import sha256_file

MANIFEST = "manifest.json"
SIGNATURE = "signature"
SIGNATURE_SCHEME = "hmac-sha256"
MIN_KEY_BYTES = 16
MAX_MANIFEST_BYTES = 64 * 2**20  # a manifest lists a few thousand files at most; more is not one
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Zero-byte markers a rank leaves while uploading (posttrain.store.uploader); never read, never in a manifest.
UPLOAD_MARKER_PREFIX = ".uploaded-"


@dataclass(frozen=True)
class CheckpointTrust:
    """What a checkpoint is checked against besides its own manifest."""

    key: bytes | None = None  # store.signing_key's bytes: manifests must carry its signature
    max_step: int | None = None  # train.max_steps: a checkpoint past it is not this run's


UNSIGNED = CheckpointTrust()  # the default: no key, no step bound


class ManifestError(ValueError):
    """A manifest (or a file it lists) that cannot be trusted: the checkpoint is invalid."""


class CheckpointSignatureError(ValueError):
    """A manifest without the signature ``store.signing_key`` requires, or with another one (exit 2)."""


def member_name(name: Any) -> str:
    """``name`` when it is a safe relative path inside a directory; else ``ManifestError``."""
    if not isinstance(name, str) or not name:
        raise ManifestError(f"file name {name!r} is not a non-empty string")
    if "\\" in name or "\x00" in name or name.startswith("/") or re.match(r"[A-Za-z]:", name):
        raise ManifestError(f"file name {name!r} is not a relative path inside the checkpoint")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise ManifestError(f"file name {name!r} leaves the checkpoint directory or is not normalised")
    return name


def member_path(directory: Path, name: Any) -> Path:
    """``directory / name``, checked to stay inside ``directory`` (also through symlinked parent directories;
    the file itself is not followed: callers ``lstat`` it and refuse anything but a regular file)."""
    path = directory / member_name(name)
    base = directory.resolve()
    if not path.parent.resolve().is_relative_to(base):
        raise ManifestError(f"file name {name!r} resolves outside {directory}")
    return path


def canonical(manifest: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the manifest without its signature, as canonical JSON."""
    body = {key: value for key, value in manifest.items() if key != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_manifest(manifest: dict[str, Any], key: bytes | None) -> dict[str, Any]:
    """``manifest`` with its ``signature`` (unchanged without a key)."""
    if key is None:
        return manifest
    digest = hmac.new(key, canonical(manifest), hashlib.sha256).hexdigest()
    return {**manifest, SIGNATURE: f"{SIGNATURE_SCHEME}:{digest}"}


def check_signature(manifest: dict[str, Any], key: bytes | None, where: str) -> None:
    """Raise ``CheckpointSignatureError`` unless ``manifest`` is signed with ``key`` (no key: nothing to check)."""
    if key is None:
        return
    signature = manifest.get(SIGNATURE)
    fix = ("the store holds a checkpoint that store.signing_key did not sign. If you wrote it (before signing was "
           "on, or with another key), resume with the key it was written with or without store.signing_key; "
           "otherwise someone else can write this run's store — do not resume from it")
    if not isinstance(signature, str):
        raise CheckpointSignatureError(f"{where}: manifest is not signed; {fix}")
    expected = sign_manifest(manifest, key)[SIGNATURE]
    if not hmac.compare_digest(signature, expected):
        raise CheckpointSignatureError(f"{where}: manifest signature does not match store.signing_key; {fix}")


def _non_negative_int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ManifestError(f"{what} is {value!r}, not a non-negative integer")
    return value


def parse_manifest(data: bytes | str, *, key: bytes | None, step: int | None, where: str) -> dict[str, Any]:
    """The manifest in ``data``, its shape and names checked and (with ``key``) its signature verified.

    ``step``: the step its directory's name says; the manifest must say the same. Raises ``ManifestError``
    for a malformed manifest (the caller falls back to an older checkpoint) and ``CheckpointSignatureError``
    for a signature problem (the caller stops).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes (more than {MAX_MANIFEST_BYTES})")
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ManifestError(f"manifest unreadable ({type(exc).__name__})") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"manifest is a JSON {type(manifest).__name__}, not an object")
    check_signature(manifest, key, where)
    saved_step = _non_negative_int(manifest.get("step"), "manifest step")
    if step is not None and saved_step != step:
        raise ManifestError(f"manifest says step {saved_step} in the directory of step {step}")
    world = _non_negative_int(manifest.get("world_size", 1), "manifest world_size")
    if world < 1:
        raise ManifestError("manifest world_size is 0")
    files, sizes = manifest.get("files"), manifest.get("sizes", {})
    if not isinstance(files, dict) or not files:
        raise ManifestError("manifest lists no files")
    if not isinstance(sizes, dict):
        raise ManifestError("manifest sizes is not an object")
    for name, digest in files.items():
        member_name(name)
        if name == MANIFEST or name.startswith(UPLOAD_MARKER_PREFIX):
            raise ManifestError(f"manifest lists {name!r}, which is never a checkpoint file")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ManifestError(f"manifest sha256 of {name} is {digest!r}, not 64 hex digits")
    for name, size in sizes.items():
        if name not in files:
            raise ManifestError(f"manifest has a size for {name!r} but no sha256")
        _non_negative_int(size, f"manifest size of {name}")
    return manifest


def read_manifest(directory: Path, *, key: bytes | None, step: int | None) -> dict[str, Any]:
    """``directory/manifest.json`` read with ``parse_manifest`` (a regular file, bounded in size)."""
    path = directory / MANIFEST
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise ManifestError("manifest missing (the save did not finish)") from None
    if not stat.S_ISREG(info.st_mode):
        raise ManifestError("manifest is not a regular file")
    if info.st_size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {info.st_size} bytes (more than {MAX_MANIFEST_BYTES})")
    return parse_manifest(path.read_bytes(), key=key, step=step, where=str(directory))


def _listed_tree(directory: Path) -> list[str]:
    """Every entry under ``directory`` (files, links, anything but directories), as relative names."""
    found = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            found.append(os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/"))
    return sorted(found)


def verify_files(directory: Path, manifest: dict[str, Any]) -> str | None:
    """Why the files in ``directory`` are not exactly ``manifest``'s, or None when they are.

    Cheap checks first (names, file types, sizes), the sha256 of each file last: a hostile entry costs nothing.
    """
    files, sizes = manifest["files"], manifest.get("sizes", {})
    unlisted = [name for name in _listed_tree(directory) if name != MANIFEST and name not in files]
    if unlisted:
        return f"file {unlisted[0]} is not in the manifest" + (f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else "")
    for name in files:
        try:
            info = os.lstat(member_path(directory, name))
        except FileNotFoundError:
            return f"file {name} missing"
        except ManifestError as exc:
            return str(exc)
        if not stat.S_ISREG(info.st_mode):
            return f"file {name} is not a regular file"
        if name in sizes and info.st_size != sizes[name]:
            return f"file {name} has {info.st_size} of {sizes[name]} bytes"
    for name, expected in files.items():
        if sha256_file(directory / name) != expected:
            return f"checksum mismatch in {name}"
    return None


def load_signing_key(spec: str | None) -> bytes | None:
    """The key ``store.signing_key`` points at: ``env:VAR`` or ``file:/path``; None when unset.

    Raises ``CheckpointSignatureError`` (exit 2) when it cannot be read or is shorter than 16 bytes.
    """
    if not spec:
        return None
    kind, _, where = spec.partition(":")
    if kind == "env":
        value = os.environ.get(where, "")
        if not value:
            raise CheckpointSignatureError(f"store.signing_key={spec}: environment variable {where} is not set")
        key = value.encode()
    elif kind == "file":
        try:
            key = Path(where).read_bytes().strip()
        except OSError as exc:
            raise CheckpointSignatureError(f"store.signing_key={spec}: cannot read {where} ({exc.strerror})") from None
    else:
        raise CheckpointSignatureError(f"store.signing_key={spec}: say where the key is, env:VAR or file:/path")
    if len(key) < MIN_KEY_BYTES:
        raise CheckpointSignatureError(f"store.signing_key={spec}: the key has {len(key)} bytes; use at least "
                                       f"{MIN_KEY_BYTES} random bytes (e.g. `openssl rand -hex 32`)")
    return key
