"""Sharded checkpoints with atomic commits, and the final HF-format export.

Layout of ``<output_dir>/checkpoints/step-000120/``:
- ``*.distcp`` + ``.metadata``: model and optimizer through ``torch.distributed.checkpoint`` (DCP),
  each rank writing its own shards.
- ``trainer.json`` (rank 0): everything else a bit-exact resume needs — the loop's step counters, the
  health history, the skip set, and the step source's state (data position, BCO's shift, a sampler's
  pass rates). It is the same on every rank, so one copy serves any number of ranks.
- ``rng-rank{r}.pt``: each rank's RNG states.
- ``manifest.json``: written **last**, by rank 0, after every file is fsynced: step, config hash and a
  sha256 per file. A checkpoint without a manifest, or whose files do not match it, is incomplete.

A checkpoint is written to ``step-N.tmp`` and renamed into place after the manifest, so a reader
never sees a half-written directory under its final name; the manifest check also covers stores
without atomic rename.

A checkpoint written by N ranks loads on M ranks: DCP reshards the model and optimizer to the new
sharding (or to whole tensors in one process), the trainer state is rank-independent, and a rank with
no RNG file of its own takes rank ``r mod N``'s (the exact data position does not depend on RNG).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from posttrain import dist

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
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


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    found = []
    if root.exists():
        for child in root.iterdir():
            if child.is_dir() and child.name.startswith("step-") and not child.name.endswith(".tmp"):
                try:
                    found.append((int(child.name.removeprefix("step-")), child))
                except ValueError:
                    continue
    return sorted(found, reverse=True)


def verify_checkpoint(path: Path) -> str | None:
    """Return why ``path`` is not a complete checkpoint, or None when it is."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return "manifest missing (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return "manifest unreadable"
    for name, expected in manifest.get("files", {}).items():
        file = path / name
        if not file.exists():
            return f"file {name} missing"
        if _sha256(file) != expected:
            return f"checksum mismatch in {name}"
    return None


def latest_valid_checkpoint(root: Path, config_hash: str | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``root``; incomplete or corrupt ones are skipped with a warning."""
    for step, path in _step_dirs(root):
        problem = verify_checkpoint(path)
        if problem:
            warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
            continue
        manifest = json.loads((path / MANIFEST).read_text())
        if config_hash and manifest.get("config_hash") not in (None, config_hash):
            warnings.warn(
                f"checkpoint {path} was written with a different config (hash {manifest.get('config_hash')} "
                f"!= {config_hash}); resuming from it anyway — data order and schedule may differ",
                stacklevel=2,
            )
        return CheckpointInfo(path, step, manifest)
    return None


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    config_hash: str,
    keep_last: int,
) -> Path:
    """Save a sharded checkpoint for ``step`` (a collective: every rank must call it)."""
    final = root / f"step-{step:06d}"
    staging = root / f"step-{step:06d}.tmp"
    if dist.is_main():
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staging), no_dist=not dist.initialized())
    rank = dist.rank()
    if dist.is_main():
        (staging / TRAINER_STATE).write_text(json.dumps(trainer_state, sort_keys=True))
    torch.save(rng_state(), staging / f"rng-rank{rank}.pt")
    dist.barrier()
    if dist.is_main():
        _fsync_tree(staging)
        files = {
            str(p.relative_to(staging)): _sha256(p) for p in sorted(staging.rglob("*")) if p.is_file()
        }
        manifest = {"step": step, "config_hash": config_hash, "world_size": dist.world_size(), "files": files}
        with open(staging / MANIFEST, "w") as handle:
            json.dump(manifest, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _fsync_tree(root)
        for _, old in _step_dirs(root)[keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(
    info: CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG (resharding when the rank count changed); return the
    trainer state."""
    saved_world = int(info.manifest.get("world_size", 1))
    world, rank = dist.world_size(), dist.rank()
    if saved_world != world and dist.is_main():
        warnings.warn(
            f"checkpoint {info.path.name} was written by {saved_world} rank(s); resharding it for {world}",
            stacklevel=2,
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(info.path), no_dist=not dist.initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = info.path / f"rng-rank{rank if rank < saved_world else rank % saved_world}.pt"
    set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((info.path / TRAINER_STATE).read_text())


def full_model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather an unsharded CPU state dict (a collective); every rank gets it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def export_hf(lm: torch.nn.Module, state_dict: dict[str, torch.Tensor], tokenizer, directory: Path) -> Path:
    """Write an HF-format model (safetensors + config + tokenizer) from a full state dict (rank 0 only)."""
    directory.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
