"""Sharded checkpoints with atomic commits, and the final HF-format export.

Layout of ``<output_dir>/checkpoints/step-000120/``:
- ``*.distcp`` + ``.metadata``: model and optimizer through ``torch.distributed.checkpoint`` (DCP),
  each rank writing its own shards.
- ``trainer.json`` (rank 0): everything else a bit-exact resume needs — the loop's step counters, the
  health history, the skip set, and the step source's state (data position, BCO's shift, a sampler's
  pass rates). It is the same on every rank, so one copy serves any number of ranks.
- ``rng-rank{r}.json``: each rank's RNG states (``.pt`` in checkpoints of earlier versions).
- ``manifest.json``: written **last**, by rank 0, after every rank has fsynced and hashed the files it
  wrote: step, world size, the run's identity (``posttrain.train.identity``) and a sha256 and size per
  file; with ``store.signing_key``, an HMAC over all of it. A checkpoint without a manifest, or whose
  directory holds other files than it lists, or other bytes, is incomplete.

Loading trusts nothing in the directory but what the manifest vouches for, and runs no code from it
(``posttrain.store.manifest``, ``posttrain.train.checkpoint_safety``; docs/security.md).

A checkpoint is written to ``step-N.tmp`` and renamed into place after the manifest, so a reader
never sees a half-written directory under its final name; the manifest check also covers stores
without atomic rename.

With frozen parameters (``model.lora``: a frozen base with trainable adapters) the model part holds the
trainable parameters only — the adapters and their optimizer state, a few MB for a model of many GB —
and the manifest says ``"weights": "trainable"``. The frozen base is not saved: it is ``model.path``,
whose content hash is part of the run identity, so a resume with other base files is refused before
anything loads. With every parameter trainable (full fine-tuning) the checkpoint holds the whole
model, as it always did.

With a remote ``output_dir`` this is the local half: ``posttrain.store.uploader`` uploads the committed
directory in the background, manifest last.

A checkpoint written by N ranks loads on M ranks: DCP reshards the model and optimizer to the new
sharding (or to whole tensors in one process), the trainer state is rank-independent, and a rank with
no RNG file of its own takes rank ``r mod N``'s (the exact data position does not depend on RNG).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from posttrain import dist
from posttrain.data.storage import sha256_file
from posttrain.store.manifest import (
    MANIFEST,
    UNSIGNED,
    CheckpointTrust,
    ManifestError,
    read_manifest,
    sign_manifest,
    verify_files,
)
from posttrain.train.checkpoint_safety import (
    SafeFileSystemReader,
    WeightsOnlyLoadPlanner,
    check_trainer_state,
    load_legacy_rng,
    read_dcp_metadata,
    rng_state_from_json,
    rng_state_json,
)

TRAINER_STATE = "trainer.json"
DCP_METADATA = ".metadata"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _quiet_single_process():
    # DCP warns that it "assumes the intent is to save in a single process" — which is exactly our intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]

    @classmethod
    def at(cls, root: Path, step: int, manifest: dict[str, Any]) -> CheckpointInfo:
        """Checkpoint ``step`` under ``root`` whose files were already verified against ``manifest``."""
        return cls(root / f"step-{step:06d}", step, manifest)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    found = []
    if root.exists():
        for child in root.iterdir():
            # A symlinked step directory is not one posttrain wrote (it could lead anywhere): not a checkpoint.
            if child.is_dir() and not child.is_symlink() and re.fullmatch(r"step-\d+", child.name):
                found.append((int(child.name.removeprefix("step-")), child))
    return sorted(found, reverse=True)


def read_trainer_state(path: Path, step: int, max_step: int | None) -> dict[str, Any]:
    """``trainer.json`` of the checkpoint at ``path``, its counters checked (``ManifestError`` otherwise)."""
    try:
        state = json.loads((path / TRAINER_STATE).read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{TRAINER_STATE} unreadable ({type(exc).__name__})") from None
    return check_trainer_state(state, step, max_step)


def checked_manifest(path: Path, step: int, trust: CheckpointTrust = UNSIGNED
                     ) -> tuple[dict[str, Any] | None, str]:
    """``(manifest, "")`` when ``path`` is a complete checkpoint of ``step`` that may be trusted, else
    ``(None, why)``. A signature problem raises ``CheckpointSignatureError`` instead: it is not a damaged
    checkpoint to skip but a store that someone else writes."""
    try:
        manifest = read_manifest(path, key=trust.key, step=step)
        problem = verify_files(path, manifest)
        if problem is None:
            check_small_files(path, manifest, step, trust.max_step)
    except ManifestError as exc:
        return None, str(exc)
    return (manifest, "") if problem is None else (None, problem)


def check_small_files(path: Path, manifest: dict[str, Any], step: int, max_step: int | None) -> None:
    """Read what a load reads before the weights — DCP's metadata, the RNG states, ``trainer.json`` — through
    the checks of ``checkpoint_safety``, so a planted one makes the checkpoint invalid before loading starts."""
    files = manifest["files"]
    if DCP_METADATA not in files:
        raise ManifestError(f"manifest lists no {DCP_METADATA}")
    read_dcp_metadata((path / DCP_METADATA).read_bytes(), manifest)
    if TRAINER_STATE not in files:
        raise ManifestError(f"manifest lists no {TRAINER_STATE}")
    read_trainer_state(path, step, max_step)
    info = CheckpointInfo(path, step, manifest)
    for name in files:
        match = re.fullmatch(r"rng-rank(\d+)\.(?:json|pt)", name)
        if match:
            read_rng_state(info, int(match.group(1)))


def verify_checkpoint(path: Path, trust: CheckpointTrust = UNSIGNED) -> str | None:
    """Return why ``path`` is not a complete checkpoint, or None when it is."""
    match = re.fullmatch(r"step-(\d+)", path.name)
    return checked_manifest(path, int(match.group(1)) if match else -1, trust)[1] or None


def latest_valid_checkpoint(root: Path, trust: CheckpointTrust = UNSIGNED,
                            skipped: Callable[[str, str], None] | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``root``; incomplete, corrupt or untrustworthy ones are skipped
    with a warning (and ``skipped(where, why)``, which the runner turns into an alert).

    Whether this run may resume it is ``posttrain.train.identity.plan_resume``'s decision.
    """
    for step, path in _step_dirs(root):
        manifest, problem = checked_manifest(path, step, trust)
        if manifest is None:
            warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
            if skipped is not None:
                skipped(str(path), problem)
            continue
        return CheckpointInfo(path, step, manifest)
    return None


LOW_SPACE_BYTES = 16 * 2**20  # a failed save with less than this free on the device is a full disk


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 1 << 62


class DiskFullError(OSError):
    """A checkpoint could not be written for lack of space; the partial one was removed."""


def _is_disk_full(exc: BaseException) -> bool:
    """ENOSPC anywhere in ``exc`` (DCP wraps the writers' errors per rank, in its message too)."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error):
            return True
        stack.extend([error.__cause__, error.__context__])
        for failure in getattr(error, "failures", {}).values():
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    return False


# Names that wrappers add to parameter names and DCP's state-dict keys leave out (activation checkpointing,
# torch.compile).
_WRAPPER_NAMES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def trainable_keys(model: torch.nn.Module) -> set[str] | None:
    """State-dict keys of the trainable parameters when some are frozen (LoRA); None when all train."""
    named = list(model.named_parameters())
    if all(p.requires_grad for _, p in named):
        return None
    keys = set()
    for name, param in named:
        if param.requires_grad:
            for wrapper in _WRAPPER_NAMES:
                name = name.replace(wrapper, "")
            keys.add(name)
    return keys


def _only(state: dict[str, Any], keys: set[str] | None) -> dict[str, Any]:
    """``state`` restricted to ``keys`` (the frozen weights and a 4-bit base's quantisation state go)."""
    if keys is None:
        return state
    missing = keys - state.keys()
    if missing:
        raise RuntimeError(f"trainable parameters without a state-dict entry: {sorted(missing)[:3]}")
    return {key: value for key, value in state.items() if key in keys}


def owner(name: str) -> int:
    """The rank that writes checkpoint file ``name``: DCP names shards ``__<rank>_<n>.distcp``, each rank its
    ``rng-rank<r>.json``; rank 0 writes the rest (``.metadata``, ``trainer.json``, the manifest)."""
    match = re.fullmatch(r"__(\d+)_\d+\.distcp", name) or re.fullmatch(r"rng-rank(\d+)\.(?:json|pt)", name)
    return int(match.group(1)) if match else 0


@dataclass
class SavedCheckpoint:
    path: Path
    step: int
    files: list[str]  # the files this rank wrote (what it uploads to a remote store)


def _own_files(staging: Path) -> dict[str, tuple[str, int]]:
    """sha256 and size of the files this rank wrote, after an fsync each."""
    mine = {}
    for path in sorted(staging.rglob("*")):
        name = str(path.relative_to(staging))
        if path.is_file() and owner(name) == dist.rank():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            mine[name] = (sha256_file(path), path.stat().st_size)
    return mine


def rng_file_name(rank: int) -> str:
    return f"rng-rank{rank}.json"


def rng_state_bytes() -> bytes:
    """This process's RNG states as the JSON a checkpoint holds (no pickle: see checkpoint_safety)."""
    return json.dumps(rng_state_json(rng_state()), sort_keys=True).encode()


def build_manifest(step: int, identity: dict[str, Any], files: dict[str, tuple[str, int]],
                   trainable: set[str] | None, key: bytes | None = None) -> dict[str, Any]:
    """The commit record of a checkpoint: ``files`` maps every file of every rank to ``(sha256, size)``;
    signed with ``key`` (``store.signing_key``) when there is one."""
    manifest = {"step": step, "world_size": dist.world_size(), "identity": identity,
                "identity_hash": identity_hash(identity),
                "files": {name: sha for name, (sha, _) in sorted(files.items())},
                "sizes": {name: size for name, (_, size) in sorted(files.items())}}
    if trainable is not None:
        manifest["weights"] = "trainable"
    return sign_manifest(manifest, key)


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    identity: dict[str, Any],
    keep_last: int,
    per_node_dir: bool = False,
    signing_key: bytes | None = None,
) -> SavedCheckpoint:
    """Save a sharded checkpoint for ``step`` (a collective: every rank must call it).

    ``identity`` (``posttrain.train.identity.RunIdentity.to_dict()``) goes into the manifest, so a later run
    can tell whether it may resume from here. Every rank hashes the files it wrote; rank 0 writes the
    manifest with all of them (sha256 and size). ``per_node_dir``: ``root`` is on each node's own disk (the
    local mirror of a remote store), so each node's first process prepares and renames its directory; by
    default ``root`` is one shared directory and rank 0 does. When a write fails for lack of space on any
    rank, the half-written ``step-N.tmp`` is removed and ``DiskFullError`` is raised: the previous
    checkpoint stays the newest valid one.
    """
    final = root / f"step-{step:06d}"
    staging = root / f"step-{step:06d}.tmp"
    leader = dist.local_rank() == 0 if per_node_dir else dist.is_main()
    failure: BaseException | None = None
    mine: dict[str, tuple[str, int]] = {}
    try:
        if leader:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        trainable = trainable_keys(model)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        model_sd = _only(model_sd, trainable)
        with _quiet_single_process():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staging), no_dist=not dist.initialized())
        if dist.is_main():
            (staging / TRAINER_STATE).write_text(json.dumps(trainer_state, sort_keys=True))
        (staging / rng_file_name(dist.rank())).write_bytes(rng_state_bytes())
        dist.barrier()
        mine = _own_files(staging)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - every rank must learn of any failure first
        failure = exc  # (DCP's CheckpointException is a BaseException)
    failed = dist.all_reduce_sum(torch.tensor([1.0 if failure is not None else 0.0]))
    if float(failed) > 0:
        # Measured before the partial checkpoint is removed: some writers (torch.save's zip writer) report a
        # full disk only as a short write, so the free space is what tells.
        full = failure is not None and (_is_disk_full(failure) or _free_bytes(root) < LOW_SPACE_BYTES)
        if leader:
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()
        if failure is None:
            raise RuntimeError(f"another rank failed to write checkpoint {staging.name}; it was removed")
        if full:
            raise DiskFullError(errno.ENOSPC, f"no space left on the device while writing checkpoint {final} "
                                f"(the partial checkpoint was removed); free space and rerun to resume from the "
                                "previous checkpoint") from failure
        raise failure
    everyone = dist.gather_objects(mine)
    if dist.is_main():
        manifest = build_manifest(step, identity, {name: entry for files in everyone for name, entry in files.items()},
                                  trainable, signing_key)
        try:
            with open(staging / MANIFEST, "w") as handle:
                json.dump(manifest, handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            _fsync_dir(staging)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if exc.errno == errno.ENOSPC:
                raise DiskFullError(errno.ENOSPC, f"no space left on the device while writing checkpoint {final} "
                                    "(the partial checkpoint was removed); free space and rerun") from exc
            raise
    dist.barrier()
    if leader:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _fsync_dir(root)
        for _, old in _step_dirs(root)[keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return SavedCheckpoint(final, step, sorted(mine) + ([MANIFEST] if dist.is_main() else []))


def identity_hash(identity: dict[str, Any]) -> str:
    """A short hash of a run identity (``posttrain.train.identity``), for manifests and messages."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def load_checkpoint(
    info: CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_step: int | None = None
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG (resharding when the rank count changed); return the
    trainer state. ``info``'s files were verified against its manifest; nothing in them runs code
    (``posttrain.train.checkpoint_safety``)."""
    saved_world = int(info.manifest.get("world_size", 1))
    world, rank = dist.world_size(), dist.rank()
    if saved_world != world and dist.is_main():
        warnings.warn(
            f"checkpoint {info.path.name} was written by {saved_world} rank(s); resharding it for {world}",
            stacklevel=2,
        )
    trainable = trainable_keys(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": _only(model_sd, trainable), "optim": optim_sd}
    with _quiet_single_process():
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(info.path, info.manifest),
                     planner=WeightsOnlyLoadPlanner(), no_dist=not dist.initialized())
        except CheckpointException as exc:  # DCP wraps each rank's failure; a refused item is the user's news
            refused = _first_manifest_error(exc)
            if refused is None:
                raise
            raise refused from None
    # With frozen weights the state holds the trainable ones only; the rest stay as model.path loaded them.
    loaded = set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                            options=StateDictOptions(strict=trainable is None))
    if trainable is not None and loaded.unexpected_keys:
        raise RuntimeError(f"checkpoint {info.path.name}: unexpected weights {loaded.unexpected_keys[:3]}")
    set_rng_state(read_rng_state(info, rank if rank < saved_world else rank % saved_world))
    return read_trainer_state(info.path, info.step, max_step)


def _first_manifest_error(exc: BaseException) -> ManifestError | None:
    """The ``ManifestError`` among the per-rank failures DCP wrapped in ``exc``, if any."""
    for failure in getattr(exc, "failures", {}).values():
        error = failure[0] if isinstance(failure, tuple) else failure
        while error is not None and not isinstance(error, ManifestError):
            error = error.__cause__ or error.__context__
        if error is not None:
            return error
    return None


def read_rng_state(info: CheckpointInfo, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s RNG states from checkpoint ``info``: the JSON file, or an earlier version's ``.pt``."""
    files = info.manifest["files"]
    if rng_file_name(rank) in files:
        try:
            data = json.loads((info.path / rng_file_name(rank)).read_bytes())
        except ValueError as exc:
            raise ManifestError(f"{rng_file_name(rank)} unreadable ({type(exc).__name__})") from None
        return rng_state_from_json(data)
    if f"rng-rank{rank}.pt" in files:
        return load_legacy_rng(info.path / f"rng-rank{rank}.pt")
    raise ManifestError(f"checkpoint {info.path.name} holds no RNG state for rank {rank}")


def full_model_state_dict(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Gather an unsharded CPU state dict (a collective); rank 0 gets it.

    ``trainable_only``: only the parameters that train (LoRA: the adapters), so the frozen base is never
    gathered.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    return _only(state, trainable_keys(model)) if trainable_only and state else state


def export_hf(lm: torch.nn.Module, state_dict: dict[str, torch.Tensor], tokenizer, directory: Path) -> Path:
    """Write an HF-format model (safetensors + config + tokenizer) from a full state dict (rank 0 only)."""
    from posttrain.progress import quiet_hf_progress

    quiet_hf_progress()
    directory.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
