"""``temperature`` and ``return_entropy`` of the chunked log-prob head: by hand against a full softmax, and
the default path unchanged bit for bit."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.logprobs import chunked_token_logprobs


def _inputs():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=generator, requires_grad=True)
    weight = torch.randn(11, 8, generator=generator, requires_grad=True)
    return hidden, weight, torch.randint(0, 11, (13,), generator=generator)


def test_default_is_the_untempered_formula_bit_for_bit():
    hidden, weight, targets = _inputs()
    logits = (hidden @ weight.T).float()
    old_formula = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
    for keep in (0, 2**30):  # recomputed and kept logits
        assert torch.equal(chunked_token_logprobs(hidden, weight, targets, 5, keep_logits_bytes=keep), old_formula)


@pytest.mark.parametrize("keep", [0, 2**30])
def test_temperature_and_entropy_against_the_full_softmax(keep):
    hidden, weight, targets = _inputs()
    temperature = 0.7
    values, entropy = chunked_token_logprobs(hidden, weight, targets, 5, keep_logits_bytes=keep,
                                             temperature=temperature, return_entropy=True)
    logprobs = torch.log_softmax(hidden.double() @ weight.double().T / temperature, -1)
    assert torch.allclose(values.double(), logprobs.gather(-1, targets[:, None]).squeeze(-1), atol=1e-5)
    assert torch.allclose(entropy.double(), -(logprobs.exp() * logprobs).sum(-1), atol=1e-5)
    assert not entropy.requires_grad
    values.sum().backward()  # gradients of the tempered log-probs: d/dz (z_t/T - lse(z/T)) = (onehot - p)/T
    p = logprobs.exp().float()
    onehot = torch.nn.functional.one_hot(targets, 11).float()
    assert torch.allclose(hidden.grad, ((onehot - p) / temperature) @ weight.detach(), atol=1e-4)


def test_temperature_must_be_positive():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_token_logprobs(hidden, weight, targets, temperature=0.0)
