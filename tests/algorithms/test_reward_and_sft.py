import math

import pytest
import torch

from posttrain.algorithms.reward import bradley_terry_loss, pairwise_accuracy
from posttrain.algorithms.sft import sft_loss, token_mean


def _neg_logsigmoid(x: float) -> float:
    return math.log1p(math.exp(-x))


def test_bradley_terry_hand_values_with_and_without_margin():
    chosen = torch.tensor([1.5, -0.2, 3.0])
    rejected = torch.tensor([0.5, 0.3, 3.0])
    margin = torch.tensor([0.0, 1.0, 2.0])
    expected = [_neg_logsigmoid(c - r) for c, r in [(1.5, 0.5), (-0.2, 0.3), (3.0, 3.0)]]
    assert bradley_terry_loss(chosen, rejected).tolist() == pytest.approx(expected, abs=1e-6)
    expected_margin = [_neg_logsigmoid(1.0 - 0.0), _neg_logsigmoid(-0.5 - 1.0), _neg_logsigmoid(0.0 - 2.0)]
    assert bradley_terry_loss(chosen, rejected, margin).tolist() == pytest.approx(expected_margin, abs=1e-6)


def test_bradley_terry_step_widens_the_reward_gap():
    chosen = torch.tensor([0.2, -1.0, 4.0], requires_grad=True)
    rejected = torch.tensor([0.1, 0.5, -2.0], requires_grad=True)
    before = (chosen - rejected).detach().clone()
    bradley_terry_loss(chosen, rejected, margin=torch.ones(3)).sum().backward()
    with torch.no_grad():
        chosen -= 0.5 * chosen.grad
        rejected -= 0.5 * rejected.grad
    assert bool(((chosen - rejected) > before).all())


def test_pairwise_accuracy_counts_ties_as_wrong():
    chosen = torch.tensor([2.0, 1.0, 0.0, 5.0])
    rejected = torch.tensor([1.0, 1.0, 0.5, -1.0])
    assert pairwise_accuracy(chosen, rejected) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="shape"):
        pairwise_accuracy(chosen, rejected[:2])


def test_sft_loss_hand_value():
    logps = torch.tensor([-0.5, -1.5, -2.0])
    assert float(sft_loss(logps)) == pytest.approx(0.5 + 1.5 + 2.0)
    assert float(token_mean(sft_loss(logps), 4)) == pytest.approx((0.5 + 1.5 + 2.0) / 4)


def test_sft_loss_with_global_token_count_matches_full_batch_mean_under_accumulation():
    torch.manual_seed(0)
    micro_batches = [torch.randn(n).abs().neg() for n in (3, 11, 1, 7)]
    total_tokens = sum(m.numel() for m in micro_batches)
    accumulated = sum(float(token_mean(sft_loss(m), total_tokens)) for m in micro_batches)
    full = torch.cat(micro_batches)
    assert accumulated == pytest.approx(-sum(full.tolist()) / total_tokens, rel=1e-6)
    # Per-micro-batch normalisation would not match: the count must be global.
    local = sum(float(token_mean(sft_loss(m), m.numel())) for m in micro_batches) / len(micro_batches)
    assert local != pytest.approx(accumulated, rel=1e-3)


def test_an_empty_step_is_refused():
    with pytest.raises(ValueError, match="num_loss_tokens must be positive"):
        token_mean(sft_loss(torch.zeros(0)), 0)
