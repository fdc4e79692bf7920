"""Reading a checkpoint without running its code: no unrestricted unpickler touches a checkpoint file.

A checkpoint is data written by whoever can write the run's directory or bucket prefix, and resumes happen
unattended. Python's pickle runs code while it loads, so:

- **RNG states** are JSON (``rng-rank{r}.json``): Python's Mersenne Twister words, numpy's, torch's (and
  CUDA's) generator bytes in base64. Checkpoints of earlier versions hold ``rng-rank{r}.pt`` (``torch.save``
  of a dict with numpy arrays); those load through torch's weights-only unpickler with numpy's array types
  allowed and nothing else.
- **DCP's ``.metadata``** is a pickle (torch 2.13's ``FileSystemReader`` calls ``pickle.load``). It is read by
  ``MetadataUnpickler``, which resolves only the classes DCP's metadata consists of (its dataclasses, torch
  dtypes and layouts, ``torch.Size``, ``pathlib`` paths); anything else is refused. Every storage entry must
  name a file of the manifest, inside the checkpoint, within that file's size.
- **DCP's byte items** (the optimizer's ``param_groups``: floats, tuples, strings) are loaded by
  ``WeightsOnlyLoadPlanner`` with ``torch.load(weights_only=True)``; torch's default planner uses
  ``weights_only=False``. Tensors were already loaded weights-only by DCP.
- **``trainer.json``** is JSON, checked against the manifest's step and the run's ``train.max_steps``.
"""

from __future__ import annotations

import base64
import io
import pathlib
import pickle
import re
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from posttrain.store.manifest import ManifestError, member_name

RNG_FORMAT = 1


# -- RNG state as JSON ------------------------------------------------------------------------------------
def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def rng_state_json(state: dict[str, Any]) -> dict[str, Any]:
    """``posttrain.train.checkpoint.rng_state()`` as JSON-ready data (exact: floats round-trip through repr)."""
    version, words, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    out = {"format": RNG_FORMAT, "python": {"version": version, "words": list(words), "gauss": gauss},
           "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                     "cached_gaussian": float(cached)},
           "torch": _b64(state["torch"])}
    if "cuda" in state:
        out["cuda"] = [_b64(generator) for generator in state["cuda"]]
    return out


def _generator_bytes(text: Any, length: int | None, what: str) -> torch.Tensor:
    if not isinstance(text, str):
        raise ManifestError(f"RNG state {what} is not base64 text")
    raw = base64.b64decode(text, validate=True)
    if length is not None and len(raw) != length:
        raise ManifestError(f"RNG state {what} has {len(raw)} bytes, not {length}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _words(values: Any, count: int, what: str) -> list[int]:
    if not isinstance(values, list) or len(values) != count or not all(
            type(v) is int and 0 <= v < 2**32 for v in values):
        raise ManifestError(f"RNG state {what} is not {count} 32-bit words")
    return values


def rng_state_from_json(data: Any) -> dict[str, Any]:
    """The inverse of ``rng_state_json``, every field checked; ``ManifestError`` for anything else."""
    try:
        if not isinstance(data, dict) or data.get("format") != RNG_FORMAT:
            raise ManifestError("RNG state is not a posttrain RNG record")
        py, npy = data["python"], data["numpy"]
        gauss = py["gauss"]
        if gauss is not None and type(gauss) is not float:
            raise ManifestError("RNG state python.gauss is not a float")
        python = (int(py["version"]), tuple(_words(py["words"], 625, "python.words")), gauss)
        if npy["kind"] != "MT19937" or type(npy["pos"]) is not int or not 0 <= npy["pos"] <= 624:
            raise ManifestError("RNG state numpy is not an MT19937 state")
        numpy_state = ("MT19937", np.array(_words(npy["keys"], 624, "numpy.keys"), dtype=np.uint32), npy["pos"],
                       int(bool(npy["has_gauss"])), float(npy["cached_gaussian"]))
        state = {"python": python, "numpy": numpy_state,
                 "torch": _generator_bytes(data["torch"], torch.get_rng_state().numel(), "torch")}
        if "cuda" in data:
            if not isinstance(data["cuda"], list):
                raise ManifestError("RNG state cuda is not a list")
            state["cuda"] = [_generator_bytes(text, None, "cuda") for text in data["cuda"]]
        return state
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"RNG state malformed ({type(exc).__name__}: {exc})") from None


def load_legacy_rng(path: pathlib.Path) -> dict[str, Any]:
    """``rng-rank{r}.pt`` of checkpoints written before the JSON format: torch's weights-only unpickler, with
    numpy's array reconstruction allowed (what ``np.random.get_state()`` pickles to) and nothing more."""
    reconstruct = np._core.multiarray._reconstruct
    # numpy 2 pickles name numpy._core, numpy 1's numpy.core: the same function under both names.
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), reconstruct,
               (reconstruct, "numpy.core.multiarray._reconstruct")]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ManifestError(f"{path.name} holds more than RNG state ({refused_global(exc)}); refused") from None
    # Re-check it through the JSON form: the same validation as a current checkpoint.
    try:
        return rng_state_from_json(rng_state_json(state))
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{path.name}: RNG state malformed ({exc})") from None


def refused_global(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused, from its message (which is long, and has terminal codes)."""
    found = re.search(r"(?:Unsupported global: GLOBAL|Unsupported operand|Unsupported class) ?([\w.]*)", str(exc))
    return found.group(0) if found else "not plain data"


# -- DCP metadata through an allow-list ---------------------------------------------------------------------
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in
    ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
     "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


class MetadataUnpickler(pickle.Unpickler):
    """Resolves only what DCP's metadata is made of; any other global is refused (``ManifestError``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format):
            return getattr(torch, name)
        raise ManifestError(f"DCP metadata refers to {module}.{name}, which checkpoint metadata never holds; refused")


def read_dcp_metadata(data: bytes, manifest: dict[str, Any]) -> Metadata:
    """The ``.metadata`` in ``data``, loaded through ``MetadataUnpickler`` and checked against ``manifest``."""
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except ManifestError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises many kinds; all mean "not metadata"
        raise ManifestError(f"DCP metadata unreadable ({type(exc).__name__})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ManifestError("DCP metadata is not a checkpoint's metadata")
    files, sizes = manifest["files"], manifest.get("sizes", {})
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo):
            raise ManifestError("DCP metadata storage entry of another type")
        name = member_name(info.relative_path)
        if name not in files:
            raise ManifestError(f"DCP metadata points into {name}, which the manifest does not list")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0 or (
                name in sizes and info.offset + info.length > sizes[name]):
            raise ManifestError(f"DCP metadata reads outside {name}")
        if info.transform_descriptors:
            raise ManifestError(f"DCP metadata asks for transforms {info.transform_descriptors!r} on {name}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader whose metadata comes through ``read_dcp_metadata``."""

    def __init__(self, path: pathlib.Path, manifest: dict[str, Any]):
        super().__init__(path)
        self.manifest = manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # noqa: ARG002 - one .metadata, no per-rank files
        with open(pathlib.Path(self.path) / ".metadata", "rb") as handle:
            metadata = read_dcp_metadata(handle.read(), self.manifest)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that byte items (non-tensor state) load weights-only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ManifestError(f"checkpoint item {read_item.dest_index.fqn} holds more than data "
                                f"({refused_global(exc)}); refused") from None
        # What DefaultLoadPlanner.load_bytes does with torch.load's result, given the checked one instead.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# -- trainer.json -----------------------------------------------------------------------------------------
TRAINER_INT_FIELDS = ("next_step", "optimizer_steps", "rollbacks")


def check_trainer_state(state: Any, step: int, max_step: int | None) -> dict[str, Any]:
    """``trainer.json``'s content when its counters fit the checkpoint (``step``) and the run (``max_step``)."""
    if not isinstance(state, dict):
        raise ManifestError("trainer.json is not a JSON object")
    for key in TRAINER_INT_FIELDS:
        if type(state.get(key)) is not int or state[key] < 0:
            raise ManifestError(f"trainer.json {key} is {state.get(key)!r}, not a non-negative integer")
    if state["next_step"] != step:
        raise ManifestError(f"trainer.json says step {state['next_step']} in the checkpoint of step {step}")
    if state["optimizer_steps"] > step:
        raise ManifestError(f"trainer.json counts {state['optimizer_steps']} optimizer steps in {step} steps")
    if max_step is not None and step > max_step:
        raise ManifestError(f"checkpoint of step {step} is past the run's last step ({max_step}, train.max_steps)")
    if not isinstance(state.get("skip", []), list) or not isinstance(state.get("source", {}), dict):
        raise ManifestError("trainer.json skip or source state of the wrong type")
    return state
