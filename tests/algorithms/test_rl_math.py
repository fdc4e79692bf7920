"""The RL math (posttrain.algorithms.rl / rl_losses) against values worked out by hand in the comments."""

import math

import pytest
import torch

from posttrain.algorithms.registry import UnknownNameError
from posttrain.algorithms.rl import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    clip_fractions,
    kl_per_token,
    loss_units,
    rl_token_loss,
)
from posttrain.algorithms.rl_losses import Aggregation

EPS = 1e-6
F64 = torch.float64

# Six completions from three prompts, ids neither contiguous nor equal-sized:
#   prompt 7: completions 0, 2, 4 with rewards 2, 0, 1  → mean 1, deviations +1, −1, 0
#   prompt 3: completions 1, 3    with rewards 0, 4     → mean 2, deviations −2, +2
#   prompt 9: completion 5        with reward 5         → a group of one
REWARDS = torch.tensor([2.0, 0.0, 0.0, 4.0, 1.0, 5.0], dtype=F64)
GROUPS = torch.tensor([7, 3, 7, 3, 7, 9])


def assert_close_to(actual, expected, atol=1e-9):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# --- advantages ---------------------------------------------------------------------------------


def test_grpo_advantages_by_hand_with_the_unbiased_std():
    # prompt 7: Σ(dev²) = 2, Bessel: var = 2 / (3 − 1) = 1, std 1      → A = ±1/(1+ε), 0
    # prompt 3: Σ(dev²) = 8, Bessel: var = 8 / (2 − 1) = 8, std 2√2   → A = ∓2/(2√2+ε) ≈ ∓0.7071
    # prompt 9: a group of one                                         → 0
    s3 = 2 * math.sqrt(2)
    expected = [1 / (1 + EPS), -2 / (s3 + EPS), -1 / (1 + EPS), 2 / (s3 + EPS), 0.0, 0.0]
    assert_close_to(ADVANTAGES.get("grpo")(REWARDS, GROUPS, EPS), expected)


def test_grpo_two_samples_give_0707_not_1():
    # G = 2, rewards {0, 1}: mean ½, unbiased std √(½) → ±½/√½ = ±0.70711 (population std ½ would give ±1).
    advantages = ADVANTAGES.get("grpo")(torch.tensor([0.0, 1.0], dtype=F64), torch.tensor([0, 0]), 0.0)
    assert_close_to(advantages, [-math.sqrt(0.5), math.sqrt(0.5)])


def test_dr_grpo_advantages_by_hand():
    # r − mean_g: prompt 7 → +1, −1, 0; prompt 3 → −2, +2; prompt 9 → 5 − 5 = 0
    assert_close_to(ADVANTAGES.get("dr_grpo")(REWARDS, GROUPS), [1.0, -2.0, -1.0, 2.0, 0.0, 0.0])


def test_rloo_advantages_by_hand():
    # prompt 7: 2 − (0+1)/2 = 1.5, 0 − (2+1)/2 = −1.5, 1 − (2+0)/2 = 0; prompt 3: 0 − 4 = −4, 4 − 0 = 4;
    # prompt 9 has no other completion → 0
    assert_close_to(ADVANTAGES.get("rloo")(REWARDS, GROUPS), [1.5, -4.0, -1.5, 4.0, 0.0, 0.0])


def test_reinforce_pp_baseline_advantages_by_hand():
    # centred x = [1, −2, −1, 2, 0, 0], batch mean 0, population var (1+4+1+4)/6 = 5/3, std √(5/3) ≈ 1.29099
    std = math.sqrt(5 / 3)
    expected = [v / (std + EPS) for v in (1.0, -2.0, -1.0, 2.0, 0.0, 0.0)]  # ≈ [0.7746, −1.5492, …]
    assert_close_to(ADVANTAGES.get("reinforce_pp_baseline")(REWARDS, GROUPS, EPS), expected)


def test_reinforce_pp_baseline_whitens_over_the_batch_not_the_group():
    # Two prompts with different spreads: centred x = [−1, 1, −3, 3], population std √((1+1+9+9)/4) = √5.
    # Per-group whitening would give ±1 for both; batch whitening keeps the 1 : 3 ratio.
    rewards = torch.tensor([0.0, 2.0, 0.0, 6.0], dtype=F64)
    advantages = ADVANTAGES.get("reinforce_pp_baseline")(rewards, torch.tensor([0, 0, 1, 1]), 0.0)
    assert_close_to(advantages, [-1 / math.sqrt(5), 1 / math.sqrt(5), -3 / math.sqrt(5), 3 / math.sqrt(5)])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_equal_reward_groups_and_groups_of_one_get_exactly_zero(name):
    # prompt 0: seven rewards of 0.1 — in float32 their mean is 7.5e-9 off 0.1, which GRPO's (std + ε)
    # would turn into advantages of ±0.007; prompt 1: a single completion; prompt 2 has signal.
    rewards = torch.tensor([0.1] * 7 + [0.7, 0.0, 1.0], dtype=torch.float32)
    advantages = ADVANTAGES.get(name)(rewards, torch.tensor([0] * 7 + [1, 2, 2]))
    assert advantages[:8].tolist() == [0.0] * 8
    assert advantages[8] < 0 < advantages[9]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_advantages_follow_their_completions_under_permutation_and_relabelling(name):
    estimator = ADVANTAGES.get(name)
    order = torch.tensor([4, 1, 5, 0, 3, 2])
    relabelled = torch.tensor([{7: 100, 3: -5, 9: 0}[int(g)] for g in GROUPS[order]])
    assert_close_to(estimator(REWARDS[order], relabelled), estimator(REWARDS, GROUPS)[order], atol=1e-12)


def test_advantage_dtypes_and_input_checks():
    grpo = ADVANTAGES.get("grpo")
    assert grpo(REWARDS.to(torch.bfloat16), GROUPS).dtype == torch.float32
    assert grpo(REWARDS, GROUPS).dtype == F64
    assert grpo(REWARDS, GROUPS.to(torch.int32)).dtype == F64
    with pytest.raises(ValueError, match="integer tensor"):
        grpo(REWARDS, GROUPS.double())
    with pytest.raises(ValueError, match="like rewards"):
        grpo(REWARDS, GROUPS[:3])
    with pytest.raises(ValueError, match="one reward per completion"):
        grpo(REWARDS.view(2, 3), GROUPS.view(2, 3))
    with pytest.raises(ValueError, match="finite"):
        grpo(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


# --- policy losses ------------------------------------------------------------------------------
# Two completions of four tokens, old log-probs −1, ratios chosen so every corner of the clip shows up.
# clip_low = 0.2 (lower bound 0.8), clip_high = 0.28 (upper bound 1.28, DAPO's clip-higher).
RATIOS = [[1.5, 1.25, 0.5, 1.0], [0.5, 1.5, 0.75, 1.0]]
ADVANTAGE = [1.0, -2.0]
MASK = [[True, True, True, False], [True, True, True, True]]


def _policy_inputs(ratios=RATIOS):
    old = torch.full((2, 4), -1.0, dtype=F64)
    logp = (old + torch.log(torch.tensor(ratios, dtype=F64))).requires_grad_()
    return logp, old, torch.tensor(ADVANTAGE, dtype=F64), torch.tensor(MASK)


def test_clipped_loss_values_gradients_and_clip_counts_by_hand():
    logp, old, adv, mask = _policy_inputs()
    with torch.no_grad():
        logp[0, 3] = float("nan")  # a padding position: masked, so it must not reach value or gradient
    loss, stats = POLICY_LOSSES.get("clipped")(logp, old, adv, mask, 0.2, 0.28)
    # ℓ = −min(ρA, clip(ρ)A); where the unclipped term wins, ∂ℓ/∂log π = −A·ρ, where the clip wins, 0.
    # row 0, A = +1: ρ 1.5 → clip 1.28: ℓ −1.28, grad 0 (high clip) | ρ 1.25 < 1.28: ℓ −1.25, grad −1.25
    #                ρ 0.5 (A > 0, low side not clipped): ℓ −0.5, grad −0.5 | masked: 0, 0
    # row 1, A = −2: ρ 0.5 → min(−1.0, −0.8·2 = −1.6) = −1.6: ℓ 1.6, grad 0 (low clip)
    #                ρ 1.5 → min(−3.0, −2.56) = −3: ℓ 3, grad 2·1.5 = 3 (no dual clip)
    #                ρ 0.75 → min(−1.5, −1.6) = −1.6: ℓ 1.6, grad 0 (low clip) | ρ 1: ℓ 2, grad 2
    assert_close_to(loss, [[-1.28, -1.25, -0.5, 0.0], [1.6, 3.0, 1.6, 2.0]], atol=1e-12)
    loss.sum().backward()
    assert_close_to(logp.grad, [[0.0, -1.25, -0.5, 0.0], [0.0, 3.0, 0.0, 2.0]], atol=1e-12)
    assert {k: float(v) for k, v in stats.items()} == {"loss_tokens": 7.0, "clip_low_tokens": 2.0, "clip_high_tokens": 1.0}


def test_symmetric_clip_stops_the_token_that_clip_higher_lets_through():
    # ρ = 1.25, A = +1: with clip_high 0.2 the bound is 1.2 → ℓ = −1.2 and gradient 0 (with 0.28 it was −1.25).
    logp, old, adv, mask = _policy_inputs()
    loss, stats = POLICY_LOSSES.get("clipped")(logp, old, adv, mask, 0.2, 0.2)
    assert_close_to(loss[0, 1], -1.2, atol=1e-12)
    loss.sum().backward()
    assert logp.grad[0, 1] == 0.0 and stats["clip_high_tokens"] == 2.0


def test_reinforce_value_is_minus_a_and_gradient_is_minus_a_grad_logp():
    logp, _, adv, mask = _policy_inputs()
    loss, stats = POLICY_LOSSES.get("reinforce")(logp, None, adv, mask, 0.2, 0.28)
    # value −A per loss token (the ratio to a detached copy is 1), whatever the log-probs and clip bounds
    assert_close_to(loss, [[-1.0, -1.0, -1.0, 0.0], [2.0, 2.0, 2.0, 2.0]], atol=0)
    loss.sum().backward()
    assert_close_to(logp.grad, [[-1.0, -1.0, -1.0, 0.0], [2.0, 2.0, 2.0, 2.0]], atol=0)
    assert float(stats["clip_low_tokens"]) == float(stats["clip_high_tokens"]) == 0.0 and stats["loss_tokens"] == 7


def test_reinforce_gradient_through_a_model_is_minus_a_times_grad_logp():
    # log π(y) = log_softmax(θ)[y]; REINFORCE's gradient wrt θ is −A·(onehot(y) − softmax(θ)).
    theta = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
    logp = torch.log_softmax(theta, 0)[2].view(1, 1)
    loss, _ = POLICY_LOSSES.get("reinforce")(logp, None, torch.tensor([1.5], dtype=F64), torch.ones(1, 1, dtype=torch.bool))
    loss.sum().backward()
    expected = -1.5 * (torch.tensor([0.0, 0.0, 1.0], dtype=F64) - torch.softmax(theta.detach(), 0))
    assert_close_to(theta.grad, expected, atol=1e-12)


def test_clipped_equals_reinforce_on_the_first_update():
    # Right after sampling old == current, ρ = 1 and no clip binds: value and gradient are REINFORCE's.
    torch.manual_seed(0)
    base = torch.randn(3, 5, dtype=F64)
    adv, mask = torch.randn(3, dtype=F64), torch.rand(3, 5) > 0.3
    grads = []
    for name in ("clipped", "reinforce"):
        logp = base.clone().requires_grad_()
        loss, _ = POLICY_LOSSES.get(name)(logp, base, adv, mask, 0.2, 0.28)
        loss.sum().backward()
        grads.append((loss.detach(), logp.grad))
    assert_close_to(grads[0][0], grads[1][0], atol=1e-12)
    assert_close_to(grads[0][1], grads[1][1], atol=1e-12)


def test_extreme_log_ratio_stays_finite():
    # log-ratio 500 would overflow exp; clamped at 20, with A < 0 the loss is e^20·1 and the gradient finite.
    logp = torch.tensor([[499.0]], dtype=torch.float32, requires_grad=True)
    loss, _ = POLICY_LOSSES.get("clipped")(logp, torch.tensor([[-1.0]]), torch.tensor([-1.0]), torch.ones(1, 1), 0.2, 0.2)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    assert_close_to(loss, [[math.exp(20.0)]], atol=1e2)


def test_policy_loss_input_checks():
    logp, old, adv, mask = _policy_inputs()
    clipped = POLICY_LOSSES.get("clipped")
    with pytest.raises(ValueError, match="clip_low must be in"):
        clipped(logp, old, adv, mask, 1.0, 0.2)
    with pytest.raises(ValueError, match="clip_high"):
        clipped(logp, old, adv, mask, 0.2, -0.1)
    with pytest.raises(ValueError, match="one value per completion"):
        clipped(logp, old, adv[:1], mask, 0.2, 0.2)
    with pytest.raises(ValueError, match="only 0 and 1"):
        clipped(logp, old, adv, mask.double() * 0.5, 0.2, 0.2)
    with pytest.raises(ValueError, match="needs old_logprobs"):
        clipped(logp, None, adv, mask, 0.2, 0.2)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        clipped(logp, old[:, :2], adv, mask, 0.2, 0.2)
    loss, _ = clipped(logp.float(), old, adv, mask.float(), 0.2, 0.2)  # a 0/1 float mask is fine
    assert loss.dtype == torch.float32
    assert clipped(logp.detach().bfloat16(), old, adv, mask, 0.2, 0.2)[0].dtype == torch.float32


# --- KL estimators ------------------------------------------------------------------------------


def test_kl_estimators_values_and_gradients_by_hand():
    # d = log π − log π_ref per token: 0, +1, −1.
    logp = torch.tensor([[-1.0, -1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.0, -2.0, -1.0]], dtype=F64)
    expected = {
        # k1 = d; ∂/∂log π = 1
        "k1": ([0.0, 1.0, -1.0], [1.0, 1.0, 1.0]),
        # k2 = d²/2; ∂ = d
        "k2": ([0.0, 0.5, 0.5], [0.0, 1.0, -1.0]),
        # k3 = e^{−d} + d − 1: d=1 → e^{−1} ≈ 0.3679, d=−1 → e − 2 ≈ 0.7183; ∂ = 1 − e^{−d}: 1 − e^{−1}, 1 − e
        "k3": ([0.0, math.exp(-1), math.e - 2], [0.0, 1 - math.exp(-1), 1 - math.e]),
    }
    for name, (value, grad) in expected.items():
        logp.grad = None
        kl = KL_ESTIMATORS.get(name)(logp, ref)
        kl.sum().backward()
        assert_close_to(kl, [value], atol=1e-12)
        assert_close_to(logp.grad, [grad], atol=1e-12)


def test_kl_estimators_expected_gradients_over_a_categorical():
    # Exact expectation over y ~ π (weights π detached), differentiating only through log π(y):
    # E[∇k1] = 0, E[∇k2] = ∇KL(π‖ref) (reverse), E[∇k3] = ∇KL(ref‖π) (forward) — the docstrings' caveats.
    theta = torch.tensor([0.4, -0.3, 1.1, 0.0], dtype=F64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, -0.5, 0.2], dtype=F64), 0)

    def grad(f):
        theta.grad = None
        f(torch.log_softmax(theta, 0)).backward()
        return theta.grad.clone()

    weights = torch.softmax(theta.detach(), 0)
    expected_grad = {name: grad(lambda lp, n=name: (weights * KL_ESTIMATORS.get(n)(lp, ref)).sum()) for name in KL_ESTIMATORS}
    reverse = grad(lambda lp: (lp.exp() * (lp - ref)).sum())
    forward = grad(lambda lp: (ref.exp() * (ref - lp)).sum())
    assert_close_to(expected_grad["k1"], torch.zeros(4), atol=1e-12)
    assert_close_to(expected_grad["k2"], reverse, atol=1e-12)
    assert_close_to(expected_grad["k3"], forward, atol=1e-12)
    assert (reverse - forward).abs().max() > 1e-2  # the two really differ here


def test_kl_per_token_masks_padding_exactly():
    logp = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    ref = torch.tensor([[-2.0, float("nan")]])
    kl = kl_per_token(logp, ref, torch.tensor([[1, 0]]), "k3")
    kl.sum().backward()
    assert_close_to(kl, [[math.exp(-1), 0.0]], atol=1e-6)
    assert logp.grad[0, 1] == 0.0 and torch.isfinite(logp.grad).all()


# --- aggregation --------------------------------------------------------------------------------
# Per-token losses of four completions (masked entries hold junk), the last fully masked:
#   [1, 2, 3, ·]  [4, ·, ·, ·]  [5, 6, ·, ·]  [·, ·, ·, ·]   → 6 loss tokens, 3 loss-bearing sequences
AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [5.0, 6.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]], dtype=F64)
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


def test_aggregations_by_hand():
    assert loss_units(AGG_MASK) == (6, 3)
    # token_mean: (1+2+3+4+5+6)/6 = 3.5
    assert_close_to(AGGREGATIONS.get("token_mean")(AGG_LOSS, AGG_MASK), 3.5)
    # seq_mean_token_mean: (6/3 + 4/1 + 11/2)/3 = (2 + 4 + 5.5)/3 = 3.8333…
    assert_close_to(AGGREGATIONS.get("seq_mean_token_mean")(AGG_LOSS, AGG_MASK), 11.5 / 3)
    # seq_mean_token_sum_norm, L_max = 8: (6/8 + 4/8 + 11/8)/3 = 21/24 = 0.875
    assert_close_to(AGGREGATIONS.get("seq_mean_token_sum_norm")(AGG_LOSS, AGG_MASK, max_new_tokens=8), 0.875)


def _split_value_and_grad(name, loss, mask, pieces, max_new_tokens=8):
    """Σ numerator(piece) / denominator(global counts) over row pieces, and its gradient wrt the loss."""
    loss = loss.clone().requires_grad_()
    aggregation = AGGREGATIONS.get(name)
    counts = [loss_units(mask[piece]) for piece in pieces]
    denominator = aggregation.denominator(total_tokens=sum(c[0] for c in counts), total_sequences=sum(c[1] for c in counts))
    total = sum(aggregation.numerator(loss[piece], mask[piece], max_new_tokens=max_new_tokens) / denominator for piece in pieces)
    total.backward()
    return total.detach(), loss.grad


# The full batch; 4 micro-batches of 2 on one rank; 2 "ranks" × 2 micro-batches (rank r gets micro-batches
# a·W + r, as BatchGeometry deals them), plus an uneven split.
SPLITS = {
    "full": [slice(0, 8)],
    "accumulate_4x2": [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)],
    "ranks_2x2x2": [slice(0, 2), slice(4, 6), slice(2, 4), slice(6, 8)],
    "uneven": [slice(0, 1), slice(1, 6), slice(6, 8)],
}


@pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregation_does_not_change_with_accumulation_or_ranks(name):
    torch.manual_seed(1)
    loss = torch.randn(8, 6, dtype=F64)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])  # one completion fully masked, lengths all different
    mask = torch.arange(6) < lengths[:, None]
    reference = AGGREGATIONS.get(name)(loss, mask, max_new_tokens=8)
    full_value, full_grad = _split_value_and_grad(name, loss, mask, SPLITS["full"])
    assert_close_to(full_value, reference, atol=0)
    for pieces in SPLITS.values():
        value, grad = _split_value_and_grad(name, loss, mask, pieces)
        assert_close_to(value, full_value, atol=1e-13)
        assert_close_to(grad, full_grad, atol=1e-15)
    # Dyadic losses, power-of-two lengths and counts (16 tokens, 8 sequences, L_max 8) make every partial
    # sum and quotient exact: then the split is bit-identical.
    dyadic = torch.randint(-64, 64, (8, 6)).to(F64) / 8
    pow2 = torch.arange(6) < torch.tensor([4, 1, 2, 1, 4, 2, 1, 1])[:, None]
    exact = [_split_value_and_grad(name, dyadic, pow2, pieces)[0].item() for pieces in SPLITS.values()]
    assert len(set(exact)) == 1, exact


def test_aggregation_checks():
    with pytest.raises(ValueError, match="max_new_tokens > 0"):
        AGGREGATIONS.get("seq_mean_token_sum_norm")(AGG_LOSS, AGG_MASK)
    with pytest.raises(ValueError, match="every completion of the update is masked out"):
        AGGREGATIONS.get("token_mean").denominator(total_tokens=0, total_sequences=0)
    assert AGGREGATIONS.get("seq_mean_token_mean").denominator(total_tokens=10, total_sequences=3) == 3.0
    assert AGGREGATIONS.get("token_mean").denominator(total_tokens=10, total_sequences=3) == 10.0


# --- the combined per-micro-batch loss ----------------------------------------------------------


def test_rl_token_loss_adds_beta_times_kl_by_hand():
    # One completion, two tokens, on-policy (ρ = 1), A = +1 → policy term −1 per token.
    # Token 0: log π − log π_ref = 1 → k3 = e^{−1}; token 1: d = 0 → k3 = 0. β = 0.1:
    # ℓ = [−1 + 0.1·e^{−1}, −1] = [−0.963212, −1]; ∂ℓ/∂log π = [−1 + 0.1(1 − e^{−1}), −1]; kl_sum = e^{−1}
    logp = torch.tensor([[-1.0, -0.5]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-2.0, -0.5]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = rl_token_loss(logp, logp.detach(), torch.tensor([1.0], dtype=F64), mask, kl_beta=0.1, ref_logprobs=ref)
    assert_close_to(loss, [[-1 + 0.1 * math.exp(-1), -1.0]], atol=1e-12)
    loss.sum().backward()
    assert_close_to(logp.grad, [[-1 + 0.1 * (1 - math.exp(-1)), -1.0]], atol=1e-12)
    assert_close_to(stats["kl_sum"], math.exp(-1), atol=1e-12)
    # β = 0 with a reference: the loss is the policy loss alone, the KL is still measured
    plain, stats = rl_token_loss(logp, logp.detach(), torch.tensor([1.0], dtype=F64), mask, ref_logprobs=ref)
    assert_close_to(plain, [[-1.0, -1.0]], atol=0)
    assert_close_to(stats["kl_sum"], math.exp(-1), atol=1e-12)
    # k2 instead: token 0 adds 0.1·½ = 0.05
    k2, _ = rl_token_loss(logp, logp.detach(), torch.tensor([1.0], dtype=F64), mask, kl_beta=0.1, ref_logprobs=ref,
                          kl_estimator="k2")
    assert_close_to(k2, [[-0.95, -1.0]], atol=1e-12)


def test_rl_token_loss_checks_beta_and_reference():
    logp, old, adv, mask = _policy_inputs()
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        rl_token_loss(logp, old, adv, mask, kl_beta=0.04)
    with pytest.raises(ValueError, match="kl_beta must be >= 0"):
        rl_token_loss(logp, old, adv, mask, kl_beta=-0.1)
    _, stats = rl_token_loss(logp, old, adv, mask)
    assert "kl_sum" not in stats  # β = 0 and no reference: nothing about KL is computed


@pytest.mark.parametrize("policy_loss", ["clipped", "reinforce"])
def test_masked_tokens_get_zero_loss_and_zero_gradient_end_to_end(policy_loss):
    logp, old, adv, mask = _policy_inputs()
    ref = old.clone()
    with torch.no_grad():
        logp[0, 3] = float("-inf")
    old[0, 3], ref[0, 3] = float("nan"), float("inf")
    loss, _ = rl_token_loss(logp, old, adv, mask, policy_loss=policy_loss, clip_low=0.2, clip_high=0.28,
                            kl_beta=0.5, ref_logprobs=ref)
    total = AGGREGATIONS.get("token_mean")(loss, mask)
    total.backward()
    assert loss[0, 3] == 0.0 and logp.grad[0, 3] == 0.0
    assert torch.isfinite(total) and torch.isfinite(logp.grad).all() and (logp.grad[mask] != 0).any()


def test_clip_fractions_from_summed_stats():
    # e.g. two micro-batches' stats added: 20 loss tokens, 3 clipped low, 1 clipped high, KL sum 0.5
    sums = {"loss_tokens": 20.0, "clip_low_tokens": 3.0, "clip_high_tokens": 1.0, "kl_sum": 0.5}
    expected = {"clip_fraction/low": 0.15, "clip_fraction/high": 0.05, "clip_fraction": 0.2, "kl": 0.025}
    assert clip_fractions(sums) == pytest.approx(expected, abs=1e-15)
    assert clip_fractions({}) == {"clip_fraction/low": 0.0, "clip_fraction/high": 0.0, "clip_fraction": 0.0}


# --- registries ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("registry", "typo", "kind", "nearest"),
    [
        (ADVANTAGES, "grpoo", "advantage estimator", "grpo"),
        (POLICY_LOSSES, "clipped_", "policy loss", "clipped"),
        (AGGREGATIONS, "token-mean", "loss aggregation", "token_mean"),
        (KL_ESTIMATORS, "k3_", "KL estimator", "k3"),
    ],
)
def test_unknown_names_name_the_nearest(registry, typo, kind, nearest):
    with pytest.raises(UnknownNameError, match=rf"unknown {kind} '{typo}'; did you mean '{nearest}'\?"):
        registry.get(typo)


def test_registries_hold_the_documented_entries_and_refuse_duplicates():
    assert ADVANTAGES.names() == ["dr_grpo", "grpo", "reinforce_pp_baseline", "rloo"]
    assert POLICY_LOSSES.names() == ["clipped", "reinforce"]
    assert AGGREGATIONS.names() == ["seq_mean_token_mean", "seq_mean_token_sum_norm", "token_mean"]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    existing = AGGREGATIONS.get("token_mean")
    with pytest.raises(ValueError, match=r"'token_mean' is already registered .*token_mean_numerator"):
        AGGREGATIONS.add("token_mean", Aggregation(existing.numerator, "tokens"))
    assert AGGREGATIONS.get("token_mean") is existing


def test_overlong_penalty_ramps_over_the_buffer():
    from posttrain.algorithms.rl import overlong_penalty

    # L = 20, B = 4: free up to 16 tokens, then 1/4 of the penalty per token, the whole penalty at 20.
    assert [overlong_penalty(n, 20, 4, 2.0) for n in (10, 16, 17, 18, 20)] == [0.0, 0.0, 0.5, 1.0, 2.0]
    assert overlong_penalty(20, 20, 0) == 0.0  # buffer 0: off
    with pytest.raises(ValueError, match="shorter than max_new_tokens"):
        overlong_penalty(5, 8, 8)
