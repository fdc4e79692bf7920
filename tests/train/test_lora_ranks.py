"""LoRA under FSDP2 on 2 ranks (torchrun, gloo on CPU): 2 ranks == 1 rank; a checkpoint written by 2 ranks
holds both ranks' adapter shards (accelerate#4206 lost them) and resumes bit for bit on 2 ranks and to
float rounding on 1. (DPO's adapter-disabled reference pass on 2 ranks: tests/train_preference/test_lora_preference.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from tests.train.conftest import base_overrides, read_jsonl, run_in_process, run_subprocess

COMMON = {"model.lora.r": 4, "model.lora.alpha": 8, "train.lr": 5e-3, "train.max_steps": 6, "train.save_every": 2,
          "train.keep_last": 4, "train.global_batch_size": 8, "train.batch_size": 4, "train.max_grad_norm": "null"}


def losses(out) -> list[float]:
    return [m["loss"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]


def adapter(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def assert_every_shard_saved(checkpoint) -> None:
    """Every adapter tensor and its optimizer moments are stored whole, as one piece from each rank."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
    lora = [k for k in tensors if ".lora_" in k]
    assert lora and all(".lora_" in k for k in tensors if k.startswith("model."))
    for key in lora:
        chunks = tensors[key].chunks
        if key.endswith(".step"):
            continue
        assert len(chunks) == 2, key  # FSDP2 shards dim 0 over the 2 ranks: one piece each
        covered = sum(c.sizes.numel() for c in chunks)
        assert covered == tensors[key].size.numel(), key
    files = {item.relative_path for item in metadata.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}  # both ranks wrote their share


@pytest.mark.slow
def test_lora_on_two_ranks_equals_one_and_resumes_from_either(tiny_model_dir, sft_data, tmp_path):
    one, two, killed = tmp_path / "one", tmp_path / "two", tmp_path / "killed"
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, one, **COMMON)) == 0
    proc = run_subprocess(base_overrides(tiny_model_dir, sft_data, two, **COMMON), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    for key, weight in adapter(one).items():
        torch.testing.assert_close(adapter(two)[key], weight, rtol=1e-4, atol=1e-6)

    crashed = run_subprocess(base_overrides(tiny_model_dir, sft_data, killed, **{**COMMON, "debug.crash_at_step": 3}),
                             nproc=2)
    assert crashed.returncode != 0 and not (killed / "final").exists()
    assert_every_shard_saved(killed / "checkpoints" / "step-000004")
    on_one = tmp_path / "on_one"
    shutil.copytree(killed, on_one)
    resumed = run_subprocess(base_overrides(tiny_model_dir, sft_data, killed, **COMMON), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step 4" in resumed.stderr
    assert losses(killed) == losses(two)  # same ranks: bit for bit
    assert all(torch.equal(adapter(killed)[k], w) for k, w in adapter(two).items())
    assert run_in_process(base_overrides(tiny_model_dir, sft_data, on_one, **COMMON)) == 0  # 2 ranks → 1
    assert losses(on_one)[:4] == losses(two)[:4]
    assert losses(on_one) == pytest.approx(losses(two), rel=1e-5)
    for key, weight in adapter(two).items():
        torch.testing.assert_close(adapter(on_one)[key], weight, rtol=1e-4, atol=1e-6)
