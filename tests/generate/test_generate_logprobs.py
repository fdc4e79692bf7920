"""Log-probs recorded at sampling time (``SamplingParams.logprobs``): off changes nothing, on records
``log softmax(logits / T)`` of each drawn token; per-prompt seed keys."""

from __future__ import annotations

import pytest
import torch

from posttrain.generate import HFBackend, SamplingParams
from posttrain.generate.sampling import token_logprobs
from posttrain.models.load import load_model

PROMPTS = ["What is 12 plus 30?", "Hi", "The quick brown fox jumps over the lazy dog. Which is larger, 17 or 71?"]


@pytest.fixture(scope="module")
def backend(tiny_model_dir, tiny_tokenizer):
    return HFBackend(load_model(tiny_model_dir), tiny_tokenizer)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_on_or_off_sample_the_same_completions(backend, temperature):
    params = SamplingParams(n=2, temperature=temperature, top_p=0.9, max_new_tokens=10, seed=3)
    off = backend.generate(PROMPTS, params, batch_size=3, progress=False)
    on = backend.generate(PROMPTS, SamplingParams(**{**params.__dict__, "logprobs": True}), batch_size=3,
                          progress=False)
    for row_off, row_on in zip(off, on, strict=True):
        for a, b in zip(row_off, row_on, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert a.logprobs is None
            assert len(b.logprobs) == len(b.token_ids) and all(v <= 0 for v in b.logprobs)


def test_greedy_records_the_model_distribution(backend, tiny_tokenizer):
    """T = 0: the log-probs are those of softmax(logits) (T = 1), from an uncached forward here."""
    params = SamplingParams(temperature=0.0, max_new_tokens=6, logprobs=True)
    out = backend.generate([PROMPTS[1], PROMPTS[2]], params, batch_size=2, progress=False)[1][0]
    ids = list(tiny_tokenizer(PROMPTS[2])["input_ids"])
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([ids + out.token_ids])).logits[0].double()
    expected = torch.log_softmax(logits, -1)[len(ids) - 1 : -1].gather(-1, torch.tensor(out.token_ids)[:, None])
    assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), expected.squeeze(-1), atol=1e-5)


def test_token_logprobs_by_hand():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    values = token_logprobs(logits, torch.tensor([1, 0]))
    z = 2.0 + torch.log1p(torch.tensor(3.0) * torch.exp(torch.tensor(-2.0)))  # logsumexp of row 2
    assert torch.allclose(values, torch.stack([-torch.log(torch.tensor(4.0)), 2.0 - z]))


def test_seed_keys_replace_positions(backend):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=4)
    whole = backend.generate(PROMPTS, params, batch_size=4, progress=False)
    tail = backend.generate(PROMPTS[1:], params, batch_size=1, progress=False, seed_keys=[1, 2])
    assert [[c.token_ids for c in row] for row in tail] == [[c.token_ids for c in row] for row in whole[1:]]
    with pytest.raises(ValueError, match="one per prompt"):
        backend.generate(PROMPTS, params, progress=False, seed_keys=[0, 1])
    with pytest.raises(ValueError, match="distinct"):
        backend.generate(PROMPTS[:2], params, progress=False, seed_keys=[5, 5])
