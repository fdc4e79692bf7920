"""Tiny-model factory and model-level chunked log-probs (never a full [batch, seq, vocab] tensor)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.logprobs import (
    IGNORE_INDEX,
    model_token_logprobs,
    naive_token_logprobs,
    per_sequence_sum,
)
from posttrain.models.tiny import build_tiny_model


def test_tiny_model_loads_with_plain_transformers_and_has_a_chat_template(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.startswith(tokenizer.bos_token) and text.endswith("<|assistant|>\n")
    ids = tokenizer("7 + 15", add_special_tokens=False).input_ids
    assert [tokenizer.decode([i]) for i in ids if tokenizer.decode([i]).strip().isdigit()] == ["7", "1", "5"]


def test_tiny_model_is_seeded(tmp_path):
    a = build_tiny_model(tmp_path / "a", vocab_size=300, seed=3)
    b = build_tiny_model(tmp_path / "b", vocab_size=300, seed=3)
    c = build_tiny_model(tmp_path / "c", vocab_size=300, seed=4)
    wa, wb, wc = (load_model(str(p)).state_dict() for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_chunked_logprobs_equal_naive_and_have_the_same_gradients(tiny_model_dir):
    torch.manual_seed(0)
    model = load_model(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = torch.randint(3, len(tokenizer), (3, 40))
    labels = ids.clone()
    labels[:, :10] = IGNORE_INDEX  # a prompt without loss
    labels[1, 30:] = IGNORE_INDEX  # padding on one row
    chunked, rows = model_token_logprobs(model, ids, labels, chunk_size=7)
    loss_chunked = -per_sequence_sum(chunked, rows, 3).sum()
    loss_chunked.backward()
    grads_chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    naive = naive_token_logprobs(model(ids).logits, labels)
    (-naive.sum()).backward()
    assert chunked.dtype == torch.float32 and chunked.shape == naive.shape == ((labels[:, 1:] != -100).sum(),)
    torch.testing.assert_close(chunked, naive, rtol=0, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads_chunked[name], param.grad, rtol=1e-4, atol=1e-6)
