"""posttrain.models.liger (``model.liger``): the config field, the one-line setup errors, the per-instance
wiring of the kernels, the summed head of ``TokenLogprobModel``, and (CUDA only) Liger's kernels against
posttrain's own numbers.

Liger's kernels are Triton GPU kernels, so on CPU the wiring is checked with pure-torch stand-ins for the
three kernel functions (the thing under test there is which modules call them, not the kernels); the GPU
test at the end runs Liger's real kernels.
"""

from __future__ import annotations

import copy
import sys
import types
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama import modeling_llama

from posttrain.config import load_config
from posttrain.config.loader import ConfigError
from posttrain.config.recipes import SFTRecipe
from posttrain.models import liger
from posttrain.models.liger import (
    MISSING,
    NO_CUDA,
    Kernels,
    LigerSetupError,
    apply_kernels,
    check_liger,
    compare_heads,
    liger_summed_logprob,
)
from posttrain.models.load import load_model
from posttrain.models.logprobs import TokenLogprobModel
from posttrain.train.sft import run_sft, sft_root, sft_step_loss

needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_the_field_is_off_by_default_and_typed():
    assert load_config(SFTRecipe, "sft_tiny").model.liger is False
    assert load_config(SFTRecipe, "sft_tiny", ["model.liger=true"]).model.liger is True
    with pytest.raises(ConfigError, match="did you mean `model.liger`"):
        load_config(SFTRecipe, "sft_tiny", ["model.ligr=true"])
    with pytest.raises(ConfigError, match="model.liger"):
        load_config(SFTRecipe, "sft_tiny", ["model.liger=maybe"])


def _sft_config(tmp_path, model_dir, *overrides):
    return load_config(SFTRecipe, "sft_tiny", [f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}",
                                               f"data.train={tmp_path / 'never-read.jsonl'}", "model.liger=true",
                                               *overrides])


def test_a_missing_package_stops_the_run_at_setup(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as if it were not installed: import raises
    with pytest.raises(LigerSetupError) as caught:
        run_sft(_sft_config(tmp_path, tiny_model_dir))  # before any data is read (data.train does not exist)
    assert str(caught.value) == "model.liger needs the liger-kernel package: pip install 'posttrain[liger]'"
    assert str(caught.value) == MISSING


@needs_cpu
def test_no_cuda_device_stops_the_run_at_setup(tmp_path, tiny_model_dir, monkeypatch):
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError:  # not installed here: an importable stand-in, so the next check is the one reached
        for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.functional"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    with pytest.raises(LigerSetupError) as caught:
        run_sft(_sft_config(tmp_path, tiny_model_dir))
    assert str(caught.value) == "model.liger: Liger's kernels are Triton GPU kernels and need a CUDA device"
    assert str(caught.value) == NO_CUDA


def test_other_architectures_and_recompute_mlp_are_refused_in_one_line(tmp_path, tiny_model_dir):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}')
    with pytest.raises(LigerSetupError, match=r"not 'gpt2': set model.liger=false") as caught:
        check_liger(str(gpt2), False, False, torch.device("cpu"))
    assert "\n" not in str(caught.value)
    with pytest.raises(LigerSetupError, match="model.liger and train.recompute_mlp"):
        run_sft(_sft_config(tmp_path, tiny_model_dir, "train.recompute_mlp=true"))


# Pure-torch stand-ins with HF's own formulas, counting their calls: the patched model must compute exactly
# what the unpatched one does, through these functions and only for the patched instance.
def _counting_kernels(calls: Counter) -> Kernels:
    def rms_norm(x, weight, eps):
        calls["rms_norm"] += 1
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)

    def swiglu(gate, up):
        calls["swiglu"] += 1
        return F.silu(gate) * up

    def rope(q, k, cos, sin, unsqueeze_dim=1):
        calls["rope"] += 1
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + modeling_llama.rotate_half(q) * sin, k * cos + modeling_llama.rotate_half(k) * sin

    return Kernels(rms_norm=rms_norm, swiglu=swiglu, rope=rope)


def _batch(vocab: int):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (2, 12), generator=generator)
    labels = input_ids.clone()
    labels[:, :4] = -100
    return input_ids, labels


def test_only_the_patched_instance_runs_the_kernels_and_its_numbers_are_unchanged(tiny_model_dir):
    reference, patched = load_model(tiny_model_dir), load_model(tiny_model_dir)
    input_ids, labels = _batch(reference.config.vocab_size)
    with torch.no_grad():
        before = reference(input_ids).logits
    calls = Counter()
    summary = apply_kernels(patched, _counting_kernels(calls))
    layers = patched.config.num_hidden_layers
    assert summary == f"Liger kernels: {2 * layers + 1} RMSNorm, {layers} SwiGLU, RoPE in {layers} attention blocks"
    with torch.no_grad():
        after = patched(input_ids).logits
    assert calls == {"rms_norm": 2 * layers + 1, "swiglu": layers, "rope": layers}  # one forward
    assert torch.equal(after, before)
    calls.clear()
    # A deep copy of the patched model runs its own (patched) modules: change its attention, and an unpatched
    # copy changed the same way computes the same logits.
    patched_copy, reference_copy = copy.deepcopy(patched), copy.deepcopy(reference)
    with torch.no_grad():
        for model in (patched_copy, reference_copy):
            model.model.layers[0].self_attn.o_proj.weight.mul_(2.0)
        changed = patched_copy(input_ids).logits
        assert not torch.equal(changed, before) and torch.equal(changed, reference_copy(input_ids).logits)
    assert calls == {"rms_norm": 2 * layers + 1, "swiglu": layers, "rope": layers}
    # The class, and a model loaded after the patch, are HF's as before: no kernel call, the same logits.
    calls.clear()
    assert modeling_llama.LlamaRMSNorm.forward is not patched.model.norm.forward.__func__
    with torch.no_grad():
        assert torch.equal(reference(input_ids).logits, before)
        assert torch.equal(load_model(tiny_model_dir)(input_ids).logits, before)
    assert not calls
    # Gradients flow through the patched modules to every weight, as through HF's.
    root = TokenLogprobModel(patched)
    loss, _ = sft_step_loss(root, {"input_ids": input_ids, "labels": labels})
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in patched.parameters())


def test_qwen3_query_and_key_norms_are_patched_too():
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    input_ids, _ = _batch(config.vocab_size)
    with torch.no_grad():
        before = model(input_ids).logits
    calls = Counter()
    apply_kernels(model, _counting_kernels(calls))
    with torch.no_grad():
        after = model(input_ids).logits
    assert calls == {"rms_norm": 4 * 2 + 1, "swiglu": 2, "rope": 2}  # 2 per block + q_norm, k_norm; final norm
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_lora_adapters_sit_inside_the_patched_mlp(tiny_model_dir):
    from posttrain.config.sections import LoraConfig
    from posttrain.models.lora import apply_lora

    calls = Counter()
    lm = load_model(tiny_model_dir)
    apply_kernels(lm, _counting_kernels(calls))
    lm = apply_lora(lm, LoraConfig(r=4, alpha=8))
    input_ids, labels = _batch(lm.config.vocab_size)
    loss, _ = sft_step_loss(TokenLogprobModel(lm), {"input_ids": input_ids, "labels": labels})
    loss.backward()
    assert calls["swiglu"] == lm.config.num_hidden_layers
    # LoRA's B starts at zero, so only B gets a gradient on the first step: every up/gate/down B gets one.
    mlp_b = [p for n, p in lm.named_parameters() if ".lora_B." in n and "mlp" in n]
    assert mlp_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in mlp_b)


def _full_logits_sum(hidden, weight, targets):
    return torch.log_softmax(hidden.float() @ weight.float().T, dim=-1).gather(-1, targets[:, None]).sum()


def test_the_summed_forward_is_the_sum_of_token_logprobs_and_takes_another_head(tiny_model_dir):
    lm = load_model(tiny_model_dir)
    input_ids, labels = _batch(lm.config.vocab_size)
    plain = TokenLogprobModel(lm)
    with torch.no_grad():
        per_token, rows = plain(input_ids, labels)
        total, total_rows = plain(input_ids, labels, summed=True)
    assert total.shape == () and torch.equal(total, per_token.sum()) and torch.equal(rows, total_rows)
    # A summed head given to the root replaces the chunked head (here: full logits; Liger's on GPU).
    seen = []

    def head(hidden, weight, targets):
        seen.append((hidden.shape, weight is lm.get_output_embeddings().weight))
        return _full_logits_sum(hidden, weight, targets)

    with torch.no_grad():
        other, _ = TokenLogprobModel(lm, summed_head=head)(input_ids, labels, summed=True)
    assert seen == [((per_token.shape[0], lm.config.hidden_size), True)]
    torch.testing.assert_close(other, total, rtol=1e-5, atol=1e-5)
    # The SFT loss asks for the sum, so a root built with a summed head computes its loss through it.
    loss, _ = sft_step_loss(TokenLogprobModel(lm, summed_head=head), {"input_ids": input_ids, "labels": labels})
    assert len(seen) == 2 and torch.equal(loss.detach(), -other)
    with pytest.raises(ValueError, match="summed=True"):
        plain(input_ids, labels, temperature=0.7, summed=True)


def test_sft_root_picks_liger_head_only_with_model_liger(tmp_path, tiny_model_dir):
    lm = load_model(tiny_model_dir)
    assert sft_root(_sft_config(tmp_path, tiny_model_dir))(lm).summed_head is liger_summed_logprob
    assert sft_root(_sft_config(tmp_path, tiny_model_dir, "model.liger=false"))(lm).summed_head is None


def test_an_empty_micro_batch_gives_a_zero_that_reaches_the_weight():
    weight = torch.randn(16, 4, requires_grad=True)
    total = liger_summed_logprob(torch.zeros(0, 4), weight, torch.zeros(0, dtype=torch.long))
    total.backward()
    assert float(total.detach()) == 0.0 and weight.grad is not None and not weight.grad.any()


def test_compare_heads_measures_the_difference():
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(40, 8, generator=generator), torch.randn(50, 8, generator=generator)
    targets = torch.randint(0, 50, (40,), generator=generator)
    same = compare_heads(hidden, weight, targets, chunk_size=16, fused_head=_full_logits_sum)
    expected = -float(_full_logits_sum(hidden, weight, targets))
    assert same["loss_chunked"] == pytest.approx(expected, rel=1e-6)
    assert same["loss_rel_diff"] < 1e-6 and same["grad_hidden_rel_diff"] < 1e-5 and same["grad_weight_rel_diff"] < 1e-5
    assert same["peak_bytes_chunked"] is None and same["seconds_liger"] > 0  # peak memory is measured on CUDA only
    doubled = compare_heads(hidden, weight, targets, fused_head=lambda h, w, t: 2 * _full_logits_sum(h, w, t))
    assert doubled["loss_rel_diff"] == pytest.approx(1.0, rel=1e-5)
    assert doubled["grad_weight_rel_diff"] == pytest.approx(1.0, rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's kernels are Triton GPU kernels: needs CUDA")
def test_liger_kernels_match_posttrain_on_a_gpu(tiny_model_dir):
    pytest.importorskip("liger_kernel", reason="model.liger needs the liger-kernel package (posttrain[liger])")
    device = torch.device("cuda")
    check_liger(tiny_model_dir, False, False, device)
    # Fused linear cross-entropy vs the chunked head: bf16 inputs, fp32 loss; a 32k vocabulary.
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(2048, 256, device=device, generator=generator).bfloat16()
    weight = (torch.randn(32000, 256, device=device, generator=generator) * 0.05).bfloat16()
    targets = torch.randint(0, 32000, (2048,), device=device, generator=generator)
    compared = compare_heads(hidden, weight, targets, chunk_size=512)
    assert compared["loss_rel_diff"] < 1e-3, compared
    # bf16 gradients; Liger accumulates the weight gradient over its chunks in bf16, as autograd does over ours.
    assert compared["grad_hidden_rel_diff"] < 2e-2 and compared["grad_weight_rel_diff"] < 3e-2, compared
    assert compared["peak_bytes_liger"] is not None and compared["peak_bytes_chunked"] is not None
    # RMSNorm / SwiGLU / RoPE kernels on a bf16 model vs the same model unpatched; the SFT loss through the
    # Liger head vs the chunked head, and the gradients of both.
    reference = load_model(tiny_model_dir, dtype="bfloat16", device=device)
    patched = load_model(tiny_model_dir, dtype="bfloat16", device=device)
    assert apply_kernels(patched).startswith("Liger kernels:")
    input_ids, labels = (t.to(device) for t in _batch(reference.config.vocab_size))
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids).logits.float(), reference(input_ids).logits.float(),
                                   rtol=2e-2, atol=2e-2)
    losses, grads = [], []
    for root in (TokenLogprobModel(reference), TokenLogprobModel(patched, summed_head=liger_summed_logprob)):
        loss, _ = sft_step_loss(root, {"input_ids": input_ids, "labels": labels})
        loss.backward()
        losses.append(float(loss))
        grads.append(torch.cat([p.grad.float().flatten() for p in root.lm.parameters()]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 5e-2
    # A model loaded after the patch still runs HF's RoPE (the dispatcher is idle outside patched attention).
    assert liger._ROPE_KERNEL.get() is None
