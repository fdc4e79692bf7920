"""The varlen attention path (posttrain.models.attention): which implementation is chosen, the segment
boundaries it is fed, and — through the reference kernel on CPU — that a varlen model computes exactly
what the block-diagonal-mask path computes, for packed rows and for every other kind of batch."""

from __future__ import annotations

import pytest
import torch
from transformers import masking_utils
from transformers.masking_utils import find_packed_sequence_indices

from posttrain.config.sections import ModelConfig
from posttrain.data.packing import collate_packed, collate_padded, pack_examples
from posttrain.data.samples import sample_sft_records
from posttrain.data.tokenize import tokenize_records
from posttrain.models import attention
from posttrain.models.attention import (
    VARLEN,
    attention_for,
    attention_kwargs,
    reference_varlen_attention,
    resolve_attn_implementation,
    segment_boundaries,
)
from posttrain.models.load import load_model
from posttrain.models.logprobs import model_token_logprobs

MAX_LENGTH = 192


# ----------------------------------------------------------------------------- selection


@pytest.mark.parametrize(("requested", "half", "kernel", "chosen"), [
    ("auto", True, True, "varlen"),     # CUDA, bf16, torch has varlen_attn: the fast path
    ("auto", False, True, "sdpa"),      # float32 compute: Flash has no fp32 kernel
    ("auto", True, False, "sdpa"),      # no CUDA / no varlen_attn: the current path
    ("auto", False, False, "sdpa"),
    ("sdpa", True, True, "sdpa"),       # an explicit choice is kept
    ("eager", True, True, "eager"),
    ("varlen", False, False, "varlen"),  # explicit varlen runs anywhere (the reference loop)
])
def test_resolution(requested, half, kernel, chosen):
    assert resolve_attn_implementation(requested, half_precision=half, kernel_available=kernel) == chosen


def test_auto_is_sdpa_on_this_cpu_machine_and_config_defaults_to_auto():
    model = ModelConfig(path="m")
    assert model.attn_implementation == "auto"
    if torch.cuda.is_available():
        pytest.skip("the CPU answer is what this test checks; this machine has CUDA")
    assert attention_for(model, "bf16") == "sdpa"
    assert attention_for(ModelConfig(path="m", dtype="bfloat16"), "fp32") == "sdpa"
    with pytest.raises(ValueError, match="auto, sdpa, eager or varlen"):
        resolve_attn_implementation("flash", True)


def test_half_precision_means_bf16_weights_or_bf16_compute(monkeypatch):
    monkeypatch.setattr(attention, "flash_varlen_available", lambda: True)  # as on a CUDA machine
    assert attention_for(ModelConfig(path="m"), "bf16") == "varlen"
    assert attention_for(ModelConfig(path="m", dtype="bfloat16"), "fp32") == "varlen"
    assert attention_for(ModelConfig(path="m"), "fp32") == "sdpa"
    assert attention_for(ModelConfig(path="m", attn_implementation="sdpa"), "bf16") == "sdpa"


# ----------------------------------------------------------------------------- segment boundaries


def test_segment_boundaries_by_hand():
    # row 0: examples of 3 and 2 tokens, then 1 padding token; row 1: 4 tokens, then 2 padding tokens
    # that the packer numbers 0, 1 (one segment); row 2: one example filling the row.
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]])
    cu_seq_lens, longest = segment_boundaries(positions)
    assert cu_seq_lens.tolist() == [0, 3, 5, 6, 10, 12, 18]
    assert cu_seq_lens.dtype == torch.int32
    assert longest == 6
    with pytest.raises(ValueError, match=r"\[rows, seq\]"):
        segment_boundaries(torch.arange(4))


@pytest.fixture(scope="module")
def examples(tiny_tokenizer):
    tokenized, report = tokenize_records(sample_sft_records(14, seed=3), tiny_tokenizer, MAX_LENGTH, progress=False)
    assert report.truncated == 0
    return tokenized


@pytest.fixture(scope="module")
def packed(examples, tiny_tokenizer):
    rows = pack_examples(examples, MAX_LENGTH, pad_token_id=tiny_tokenizer.pad_token_id)
    assert max(len(row.example_ids) for row in rows) >= 2  # several examples really share a row
    return rows, collate_packed(rows)


def test_collated_segments_are_the_packer_rows_and_what_transformers_finds(packed):
    rows, batch = packed
    cu_seq_lens = batch["cu_seq_lens_q"].tolist()
    assert batch["cu_seq_lens_k"].tolist() == cu_seq_lens
    # from the packer's own bookkeeping: each example's start, then the row's padding segment (if any)
    expected = []
    for r, row in enumerate(rows):
        expected += [r * MAX_LENGTH + start for start in row.starts]
        end_of_examples = max(row.starts) + _last_example_length(row)
        if end_of_examples < MAX_LENGTH:
            expected.append(r * MAX_LENGTH + end_of_examples)
    expected.append(len(rows) * MAX_LENGTH)
    assert cu_seq_lens == expected
    lengths = [b - a for a, b in zip(cu_seq_lens[:-1], cu_seq_lens[1:], strict=True)]
    assert batch["max_length_q"] == batch["max_length_k"] == max(lengths)
    # transformers' packed-sequence detection sees the same segments, row by row
    indices = find_packed_sequence_indices(batch["position_ids"])
    per_row = [int(indices[r].max()) + 1 for r in range(len(rows))]
    assert sum(per_row) == len(lengths)


def _last_example_length(row) -> int:
    """Tokens of the row's last example: its positions count up from 0 until the padding restarts them."""
    start = max(row.starts)
    length = 1
    while start + length < len(row.position_ids) and row.position_ids[start + length] == length:
        length += 1
    return length


def test_padded_batches_carry_no_segments(examples, tiny_tokenizer):
    assert attention_kwargs(collate_padded(examples[:3], tiny_tokenizer.pad_token_id)) == {}


# ----------------------------------------------------------------------------- the model path


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return (load_model(tiny_model_dir, attn_implementation="sdpa"),
            load_model(tiny_model_dir, attn_implementation="varlen"))


def _logprobs_and_grads(lm, batch, segments=None):
    lm.zero_grad(set_to_none=True)
    values, _ = model_token_logprobs(lm, batch["input_ids"], batch["labels"], batch.get("attention_mask"),
                                     batch.get("position_ids"), segments=segments)
    (-values.sum()).backward()
    return values.detach(), {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}


def test_varlen_model_equals_the_mask_path_on_packed_rows(models, packed):
    sdpa, varlen = models
    assert varlen.config._attn_implementation == VARLEN
    _, batch = packed
    expected, expected_grads = _logprobs_and_grads(sdpa, batch, attention_kwargs(batch))
    got, grads = _logprobs_and_grads(varlen, batch, attention_kwargs(batch))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packed_varlen_forward_builds_no_mask_and_reads_the_segments(models, packed, monkeypatch):
    """The point of the path: no dense block-diagonal mask and no packed-sequence probe on the host."""
    _, varlen = models
    _, batch = packed
    built, probed, seen = [], [], []
    real_mask, real_probe = masking_utils.sdpa_mask, masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "sdpa_mask", lambda *a, **k: built.append(1) or real_mask(*a, **k))
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices",
                        lambda *a, **k: probed.append(1) or real_probe(*a, **k))
    real_reference = attention.reference_varlen_attention
    monkeypatch.setattr(attention, "reference_varlen_attention",
                        lambda q, k, v, cu, scale: seen.append(cu.tolist()) or real_reference(q, k, v, cu, scale))
    with torch.no_grad():
        model_token_logprobs(varlen, batch["input_ids"], batch["labels"], None, batch["position_ids"],
                             segments=attention_kwargs(batch))
    assert built == [] and probed == []
    assert seen == [batch["cu_seq_lens_q"].tolist()] * varlen.config.num_hidden_layers
    # the same batch without its segments falls back to the mask transformers builds (and stays correct)
    with torch.no_grad():
        model_token_logprobs(varlen, batch["input_ids"], batch["labels"], None, batch["position_ids"])
    assert built and probed


def test_varlen_model_is_sdpa_for_padded_and_left_padded_batches(models, examples, tiny_tokenizer):
    """Evaluation batches, preference pairs and cached generation keep their padding masks."""
    sdpa, varlen = models
    batch = collate_padded(examples[:4], tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        expected, _ = model_token_logprobs(sdpa, batch["input_ids"], batch["labels"], batch["attention_mask"])
        got, _ = model_token_logprobs(varlen, batch["input_ids"], batch["labels"], batch["attention_mask"])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # left padding, as the sampler batches prompts: the mask must reach the kernel
    ids = [e.input_ids[:20] for e in examples[:3]] + [examples[3].input_ids[:7]]
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[tiny_tokenizer.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = sdpa(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits
        have = varlen(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits
    keep = mask.bool()
    torch.testing.assert_close(have[keep], want[keep], rtol=0, atol=1e-5)


def test_packed_rows_refuse_an_attention_mask_on_the_varlen_path(models, packed):
    _, varlen = models
    _, batch = packed
    with pytest.raises(ValueError, match="packed rows carry no attention mask"):
        model_token_logprobs(varlen, batch["input_ids"], batch["labels"], torch.ones_like(batch["input_ids"]),
                             batch["position_ids"], segments=attention_kwargs(batch))


def test_reference_kernel_by_hand_with_grouped_heads():
    """Two segments, 4 query heads sharing 2 key/value heads: each token attends to its own segment's past."""
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    out = reference_varlen_attention(q, k, v, torch.tensor([0, 3, 5], dtype=torch.int32), scale=None)
    for head in range(4):
        kv = head // 2
        for start, end in ((0, 3), (3, 5)):
            for t in range(start, end):
                scores = (k[start : t + 1, kv] @ q[t, head]) / 8 ** 0.5
                expected = torch.softmax(scores, 0) @ v[start : t + 1, kv]
                torch.testing.assert_close(out[t, head], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not attention.flash_varlen_available(), reason="needs CUDA and torch's varlen_attn (Flash)")
def test_flash_kernel_matches_the_reference_in_bf16():
    torch.manual_seed(0)
    cu = torch.tensor([0, 300, 301, 1024, 2048], dtype=torch.int32, device="cuda")
    q = torch.randn(2048, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2048, 2, 64, device="cuda", dtype=torch.bfloat16), torch.randn_like(q[:, :2])
    fast = attention.flash_varlen_attention(q, k, v, cu, 1024, scale=None)
    slow = reference_varlen_attention(q.float(), k.float(), v.float(), cu, scale=None)
    torch.testing.assert_close(fast.float(), slow, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not attention.flash_varlen_available(), reason="needs CUDA and torch's varlen_attn (Flash)")
def test_a_packed_step_on_the_gpu_never_waits_for_the_device(tiny_model_dir, packed):
    """Forward and backward of a packed SFT micro-batch with no host sync: torch raises on any."""
    from posttrain.models.logprobs import POSITION_KEYS, TokenLogprobModel

    lm = load_model(tiny_model_dir, dtype="bfloat16", attn_implementation="varlen", device="cuda")
    model = TokenLogprobModel(lm)
    _, batch = packed
    batch = {key: value.cuda() if torch.is_tensor(value) else value for key, value in batch.items()}
    positions = {key: batch[key] for key in POSITION_KEYS}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logprobs, _ = model(batch["input_ids"], batch["labels"], None, batch["position_ids"],
                            segments=attention_kwargs(batch), positions=positions)
        (-logprobs.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is not None for p in lm.parameters())
