"""Host-memory offload: FSDP2 CPU offload on a CPU-only machine, and activation offload, change no number.

On CPU, host = device, so both offloads run the same kernels on the same values in the same order: the
expected result is bitwise equality with the run without offload. The tolerance (1e-6 relative, fp32)
only leaves room for a different reduction order, never for a wrong value: a stale or wrong activation
or gradient moves the loss by far more after a few steps at lr 1e-3.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from tests.train.conftest import base_overrides, final_weights, read_jsonl, run_subprocess

RTOL = 1e-6
COMMON = {"train.max_steps": 4, "train.global_batch_size": 8, "train.batch_size": 4}


def _loss_and_grads(model: torch.nn.Module, input_ids: torch.Tensor, context) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    with context:
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    # A checkpoint wrapper adds a level to the names; the parameters are the same.
    return loss.item(), {name.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                         for name, p in model.named_parameters()}


def test_activation_offload_keeps_loss_and_gradients_and_moves_fewer_tensors_under_checkpointing(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from posttrain.models.blocks import decoder_layers
    from posttrain.train.offload import ActivationOffload
    from posttrain.train.parallelize import apply_activation_checkpointing

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(decoder_layers(checkpointed), "full", 1)
    input_ids = torch.randint(0, plain.config.vocab_size, (2, 24))

    want_loss, want_grads = _loss_and_grads(plain, input_ids, contextlib.nullcontext())
    counts = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        offload = ActivationOffload()
        loss, grads = _loss_and_grads(model, input_ids, offload)
        assert loss == want_loss, name
        for key, grad in want_grads.items():
            torch.testing.assert_close(grads[key], grad, rtol=0, atol=0, msg=f"{name}: {key}")
        assert offload.pin_memory == torch.accelerator.is_available()  # pinning without one raises
        assert offload.offloaded > 0 and offload.unpacked > 0, name
        counts[name] = offload.offloaded
    # With every block checkpointed only the blocks' inputs (and what lies outside the blocks) are saved
    # through the offload hooks; the blocks' own activations are recomputed, not offloaded.
    assert 0 < counts["checkpointed"] < counts["plain"], counts


def test_activation_offload_leaves_weights_in_place():
    from posttrain.train.offload import ActivationOffload

    linear = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    offload = ActivationOffload()
    with offload:
        y = linear(torch.relu(x)).sum()
    y.backward()
    # Saved: relu's output, the input to the linear, and the weight's transpose (a view of a parameter).
    assert offload.packed > offload.offloaded > 0
    assert offload.unpacked == offload.packed


def _losses_and_grad_norms(out) -> list[tuple[float, float]]:
    return [(m["loss"], m["grad_norm"]) for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]


def _assert_same_run(got_out, want_out) -> None:
    got, want = _losses_and_grad_norms(got_out), _losses_and_grad_norms(want_out)
    assert len(got) == len(want) == COMMON["train.max_steps"]
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, want, strict=True)):
        assert loss == pytest.approx(want_loss, rel=RTOL), step
        assert norm == pytest.approx(want_norm, rel=RTOL), step
    got_w, want_w = final_weights(got_out), final_weights(want_out)
    assert got_w.keys() == want_w.keys()
    for key in want_w:
        torch.testing.assert_close(got_w[key], want_w[key], rtol=RTOL, atol=1e-7, msg=key)


def _run(model, data, out, nproc: int, **extra) -> None:
    result = run_subprocess(base_overrides(model, data, out, **COMMON, **extra), nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_activation_offload_on_one_rank_trains_exactly_like_without(tiny_model_dir, sft_data, tmp_path):
    _run(tiny_model_dir, sft_data, tmp_path / "plain", 1)
    _run(tiny_model_dir, sft_data, tmp_path / "offload", 1, **{"train.activation_offload": "true"})
    _assert_same_run(tmp_path / "offload", tmp_path / "plain")
    offloaded = [m["offloaded_tensors"] for m in read_jsonl(tmp_path / "offload" / "metrics.jsonl") if "loss" in m]
    assert offloaded and all(n > 0 for n in offloaded), offloaded


@pytest.mark.slow
def test_cpu_offload_and_activation_offload_on_two_ranks_train_like_without(tiny_model_dir, sft_data, tmp_path):
    _run(tiny_model_dir, sft_data, tmp_path / "plain", 2)
    # train.cpu_offload crashed here before (FSDP pinned host memory without an accelerator).
    _run(tiny_model_dir, sft_data, tmp_path / "cpu_offload", 2, **{"train.cpu_offload": "true"})
    _assert_same_run(tmp_path / "cpu_offload", tmp_path / "plain")
    _run(tiny_model_dir, sft_data, tmp_path / "activations", 2,
         **{"train.activation_offload": "true", "train.activation_checkpointing": "full"})
    _assert_same_run(tmp_path / "activations", tmp_path / "plain")
    offloaded = [m["offloaded_tensors"] for m in read_jsonl(tmp_path / "activations" / "metrics.jsonl") if "loss" in m]
    assert offloaded and all(n > 0 for n in offloaded), offloaded
