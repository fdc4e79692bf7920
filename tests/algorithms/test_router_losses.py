"""Router losses and the aux-free bias update against numbers worked out by hand (posttrain.algorithms.router)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms.registry import UnknownNameError
from posttrain.algorithms.router import (
    BALANCE_LOSSES,
    aux_free_bias_update,
    deepseek_v3_balance_loss,
    expert_load,
    load_entropy,
    router_z_loss,
    switch_balance_loss,
)

LN3 = math.log(3.0)


def _rows():
    """Two rows of three positions over E=2 experts; row 0's last position is padding (huge logits that would
    change every figure if it were counted)."""
    logits = torch.tensor([[[0.0, LN3], [0.0, 0.0], [50.0, -50.0]],
                           [[LN3, 0.0], [LN3, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logits, mask


def test_switch_loss_is_e_times_sum_of_fraction_times_probability():
    logits, mask = _rows()
    selected = torch.tensor([[[1], [1], [0]], [[0], [1], [0]]])
    # row 0: softmax [0.25, 0.75] and [0.5, 0.5] -> P = [0.375, 0.625]; both tokens to expert 1 -> f = [0, 1]
    #        L = 2 · (0·0.375 + 1·0.625) = 1.25
    # row 1: softmax [0.75, 0.25] ×2 and [0.5, 0.5] -> P = [2/3, 1/3]; f = [2/3, 1/3]
    #        L = 2 · (4/9 + 1/9) = 10/9
    torch.testing.assert_close(switch_balance_loss(logits, selected, mask), torch.tensor([1.25, 10 / 9]))


def test_switch_loss_is_k_at_perfect_balance_and_its_gradient_flows_through_p_only():
    logits = torch.zeros(1, 3, 3, requires_grad=True)  # uniform softmax
    selected = torch.tensor([[[0, 1], [1, 2], [2, 0]]])  # every expert chosen twice: f_i = 2/3, Σ f = K = 2
    loss = switch_balance_loss(logits, selected, torch.ones(1, 3))
    torch.testing.assert_close(loss, torch.tensor([2.0]))
    loss.sum().backward()
    # dL/dlogit_{t,j} = E/T · Σ_i f_i · p_i (δ_ij − p_j) = 0 when f is uniform: a balanced router is not pushed
    torch.testing.assert_close(logits.grad, torch.zeros_like(logits))


def test_deepseek_v3_sequence_wise_loss_uses_normalised_sigmoid_scores():
    logits, mask = _rows()
    selected = torch.tensor([[[0], [0], [1]], [[1], [1], [1]]])
    # row 0: sigmoid [0.5, 0.75] -> s' = [0.4, 0.6]; [0.5, 0.5] -> [0.5, 0.5]; P = [0.45, 0.55]
    #        f = E/(K·T) · counts = 2/2 · [2, 0] = [2, 0]; L = 2 · 0.45 = 0.9
    # row 1: s' = [0.6, 0.4] ×2 and [0.5, 0.5]: P = [1.7/3, 1.3/3]; f = 2/3 · [0, 3] = [0, 2]; L = 2.6/3
    torch.testing.assert_close(deepseek_v3_balance_loss(logits, selected, mask), torch.tensor([0.9, 2.6 / 3]))
    uniform = deepseek_v3_balance_loss(torch.zeros(1, 4, 4), torch.tensor([[[0, 1], [2, 3], [0, 2], [1, 3]]]),
                                       torch.ones(1, 4))
    torch.testing.assert_close(uniform, torch.tensor([1.0]))  # the paper's balanced value


def test_z_loss_is_mean_squared_logsumexp_over_real_tokens():
    logits, mask = _rows()
    ln2 = math.log(2.0)
    # row 0: lse [0, ln3] = ln 4, lse [0, 0] = ln 2 -> ((2 ln2)² + ln2²) / 2 = 2.5 ln2²
    # row 1: (ln4)², (ln4)², (ln2)² -> (4 + 4 + 1) ln2² / 3 = 3 ln2²
    torch.testing.assert_close(router_z_loss(logits, mask), torch.tensor([2.5 * ln2**2, 3 * ln2**2]))


def test_expert_load_counts_each_choice_of_real_tokens_once():
    _, mask = _rows()
    selected = torch.tensor([[[0, 1], [1, 0], [0, 1]], [[1, 0], [1, 0], [0, 1]]])
    torch.testing.assert_close(expert_load(selected, mask, 2), torch.tensor([5.0, 5.0]))
    torch.testing.assert_close(expert_load(selected[:, :, :1], mask, 2), torch.tensor([2.0, 3.0]))  # first choices


def test_load_entropy_is_one_when_balanced_and_zero_when_collapsed():
    assert float(load_entropy(torch.tensor([3.0, 3.0, 3.0, 3.0]))) == pytest.approx(1.0)
    assert float(load_entropy(torch.tensor([12.0, 0.0, 0.0, 0.0]))) == pytest.approx(0.0)
    assert float(load_entropy(torch.tensor([2.0, 2.0, 0.0, 0.0]))) == pytest.approx(0.5)  # log 2 / log 4


def test_aux_free_bias_update_follows_the_papers_sign_rule():
    bias = torch.tensor([0.0, 0.5, -0.1, 0.0])
    load = torch.tensor([10.0, 2.0, 6.0, 6.0])  # mean 6: expert 0 overloaded, 1 underloaded, 2 and 3 balanced
    new = aux_free_bias_update(bias, load, rate=0.01)
    torch.testing.assert_close(new, torch.tensor([-0.01, 0.51, -0.1, 0.0]))
    assert new.dtype == bias.dtype
    with pytest.raises(ValueError, match=r"\[E\]"):
        aux_free_bias_update(bias, load[:3], rate=0.01)


def test_the_deepseek_router_applies_the_bias_to_choice_only_not_to_the_gate_weights():
    """The contract the bias update relies on (transformers' DeepseekV3TopkRouter): a huge bias on expert 3
    makes every token choose it, while the weight it mixes expert 3 with stays its unbiased sigmoid score."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                              norm_topk_prob=False, routed_scaling_factor=1.0)
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
    hidden = torch.randn(5, 8)
    scores = torch.sigmoid(hidden @ router.weight.T)
    router.e_score_correction_bias.copy_(aux_free_bias_update(router.e_score_correction_bias,
                                                              torch.tensor([0.0, 0.0, 0.0, -1e4]), rate=10.0))
    _, weights, chosen = router(hidden)
    assert (chosen == 3).any(dim=-1).all()
    torch.testing.assert_close(weights, scores.gather(1, chosen))


def test_balance_losses_are_registered_by_architecture_form():
    assert BALANCE_LOSSES.names() == ["deepseek_v3", "switch"]
    with pytest.raises(UnknownNameError, match="did you mean 'switch'"):
        BALANCE_LOSSES.get("swich")
    with pytest.raises(ValueError, match="already registered"):
        BALANCE_LOSSES.add("switch", switch_balance_loss)
