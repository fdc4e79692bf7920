"""The trainer's weights, as a checkpoint-format state dict an inference engine can reload, without the run store.

``policy_weights(root, lm)`` gathers the policy's full weights on rank 0 (a collective:
``posttrain.train.checkpoint.full_model_state_dict``, FSDP2 shards included, onto the CPU) and names them
as the HF checkpoint the engine loaded at start names them (``model.layers.0.self_attn.q_proj.weight``…).
``WeightWriter`` puts them in a local directory as one safetensors file for the engine's
``reload_weights`` (``posttrain.generate.vllm_server``): by default in ``/dev/shm`` (memory, not disk) when it
has room, else under the run's working directory. Nothing goes to the run store and no checkpoint is
written; the file is deleted once the engine has loaded it. ``rollout.sync_method: broadcast`` sends the same
tensors (``engine_tensors``) over a collective instead (``posttrain.rl.weight_broadcast``).

**LoRA** (``model.lora``): the engine receives *merged* weights, ``W + scaling · B·A`` per adapted layer, and
never needs LoRA support of its own (vLLM-CPU's LoRA kernels, adapter slots, ``--max-lora-rank``), so its
numerics are the plain model's. The frozen base is gathered once and kept on rank 0 (one CPU copy of the
model); later syncs gather only the adapters (``trainable_only``), merge them into that copy in float32, and
write the full model: bytes moved from the shards are the adapters', bytes written are the model's, as
for full fine-tuning. Loading vLLM LoRA adapters instead (``/v1/load_lora_adapter``) would write only the
adapters; it is left for large models on GPU, where the write dominates.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from posttrain import dist

__all__ = ["WeightWriter", "engine_tensors", "merge_lora", "policy_weights"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _module_name(root: torch.nn.Module, module: torch.nn.Module) -> str:
    for name, candidate in root.named_modules():
        if candidate is module:
            return name
    raise ValueError("lm is not a submodule of root")


def lora_scalings(lm: torch.nn.Module) -> dict[str, tuple[float, bool]]:
    """``{layer name in the plain model: (scaling, fan_in_fan_out)}`` of each peft LoRA layer's active adapter."""
    found = {}
    for name, module in lm.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "scaling") and hasattr(module, "base_layer"):
            adapter = module.active_adapters[0] if getattr(module, "active_adapters", None) else "default"
            found[name.removeprefix("base_model.model.")] = (float(module.scaling[adapter]),
                                                             bool(getattr(module, "fan_in_fan_out", False)))
    return found


def merge_lora(state: dict[str, torch.Tensor], scalings: dict[str, tuple[float, bool]]) -> dict[str, torch.Tensor]:
    """A peft model's state dict (names relative to the ``PeftModel``) as the plain model's, adapters merged:
    ``W + scaling · B @ A`` (transposed for ``fan_in_fan_out`` layers), computed in float32 and cast back to
    W's dtype. Raises for adapter weights it does not know how to merge (DoRA magnitudes, LoRA biases,
    embedding adapters) rather than drop them."""
    merged: dict[str, torch.Tensor] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        name = key.removeprefix("base_model.model.")
        if ".lora_A." in name or ".lora_B." in name:
            layer, _, rest = name.partition(".lora_A." if ".lora_A." in name else ".lora_B.")
            if not rest.endswith(".weight"):
                raise ValueError(f"weight sync cannot merge {key}: only LoRA A/B weights are merged")
            adapters.setdefault(layer, {})["A" if ".lora_A." in name else "B"] = value
        elif "lora_" in name or ".modules_to_save." in name:
            raise ValueError(f"weight sync cannot merge {key} into plain weights; use rollout.engine=hf")
        else:
            merged[name.replace(".base_layer.", ".").replace(".original_module.", ".")] = value
    for layer, pair in adapters.items():
        if set(pair) != {"A", "B"} or f"{layer}.weight" not in merged:
            raise ValueError(f"weight sync: LoRA layer {layer} lacks its A, B or base weight")
        scaling, transpose = scalings[layer]
        base = merged[f"{layer}.weight"]
        delta = (pair["B"].float() @ pair["A"].float()) * scaling
        merged[f"{layer}.weight"] = (base.float() + (delta.T if transpose else delta)).to(base.dtype)
    return merged


class PolicyWeights:
    """Gathers ``lm``'s weights under ``root`` as checkpoint names (see the module docstring); LoRA bases cached."""

    def __init__(self, root: torch.nn.Module, lm: torch.nn.Module):
        from posttrain.models.lora import is_lora

        self.root, self.lm = root, lm
        self.prefix = _module_name(root, lm)
        self.lora = is_lora(lm)
        self.scalings = lora_scalings(lm) if self.lora else {}
        self._base: dict[str, torch.Tensor] | None = None  # rank 0, LoRA: the frozen weights, gathered once

    def gather(self) -> tuple[dict[str, torch.Tensor] | None, int]:
        """(rank 0: the full checkpoint-named weights, else None; bytes gathered). A collective."""
        from posttrain.train.checkpoint import full_model_state_dict

        adapters_only = self.lora and self._base is not None
        state = full_model_state_dict(self.root, trainable_only=adapters_only)
        if not dist.is_main():
            return None, 0
        lead = f"{self.prefix}." if self.prefix else ""
        state = {key.removeprefix(lead): value for key, value in state.items() if key.startswith(lead)}
        gathered = sum(t.numel() * t.element_size() for t in state.values())
        if not self.lora:
            return state, gathered
        if self._base is None:
            self._base = {k: v.detach().clone() for k, v in state.items() if "lora_" not in k}
            return merge_lora(state, self.scalings), gathered
        return merge_lora({**self._base, **state}, self.scalings), gathered


def policy_weights(root: torch.nn.Module, lm: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Rank 0: ``lm``'s full weights with checkpoint names (LoRA merged); other ranks: None. A collective."""
    return PolicyWeights(root, lm).gather()[0]


def default_sync_base(needed_bytes: int, work_dir: Path) -> Path:
    """``/dev/shm`` when it exists, is writable and has twice ``needed_bytes`` free; else ``work_dir/tmp``."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        with contextlib.suppress(OSError):
            if shutil.disk_usage(shm).free > 2 * needed_bytes:
                return shm
    return work_dir / "tmp"


def engine_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` as the engine loads it, whichever way it travels (file or broadcast): on the CPU, contiguous,
    floating tensors cast to the engine's ``dtype``, and a tensor tied to an earlier one (a tied output head)
    left out — the engine ties it again from its config."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, Any]] = set()
    for name, tensor in state.items():
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if identity in seen and tensor.numel() > 0:
            continue
        seen.add(identity)
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        tensors[name] = tensor.contiguous()
    return tensors


class WeightWriter:
    """Writes state dicts as ``<dir>/model.safetensors`` in the engine's dtype; ``clear()`` deletes the file."""

    def __init__(self, base: str | Path, dtype: str):
        Path(base).mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix="posttrain-weights-", dir=base))
        self.dtype = DTYPES[dtype]

    def write(self, state: dict[str, torch.Tensor]) -> int:
        """Write ``state`` as the engine loads it (``engine_tensors``); return the file's size in bytes."""
        from safetensors.torch import save_file

        path = self.directory / "model.safetensors"
        save_file(engine_tensors(state, self.dtype), str(path), metadata={"format": "pt"})
        return path.stat().st_size

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.directory / "model.safetensors").unlink()

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
