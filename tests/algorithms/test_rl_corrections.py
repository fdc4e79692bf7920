"""Training–inference mismatch corrections (posttrain.algorithms.rl_corrections) against values worked out by
hand in the comments, and how ``rl_token_loss`` applies them."""

import math

import pytest
import torch

from posttrain.algorithms.rl import IS_CORRECTIONS, mismatch_figures, rl_token_loss

F64 = torch.float64
ln = math.log

# Two completions, four token slots; the last slot of row 1 is padding (masked, and NaN on purpose: a masked
# position must give exactly 0 whatever it holds). Probabilities of the sampled tokens:
#   trainer  π_old: row 0: 0.2 0.4 0.3 0.6    row 1: 0.5 0.9 0.1  —
#   sampler  μ    : row 0: 0.8 0.5 0.2 0.2    row 1: 0.5 0.3 0.4  —
# so the token ratios ρ = π_old / μ are
#                   row 0: 0.25 0.8 1.5 3.0   row 1: 1.0 3.0 0.25 —
# and the sequence ratios Π_t ρ_t are 0.25·0.8·1.5·3 = 0.9 and 1·3·0.25 = 0.75.
TRAIN = torch.tensor([[ln(0.2), ln(0.4), ln(0.3), ln(0.6)], [ln(0.5), ln(0.9), ln(0.1), float("nan")]], dtype=F64)
BEHAVIOUR = torch.tensor([[ln(0.8), ln(0.5), ln(0.2), ln(0.2)], [ln(0.5), ln(0.3), ln(0.4), float("nan")]],
                         dtype=F64)
MASK = torch.tensor([[True, True, True, True], [True, True, True, False]])


def assert_close_to(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


def weights_of(name, **options):
    return IS_CORRECTIONS.get(name)(TRAIN, BEHAVIOUR, MASK, **options)


def test_the_registry_holds_the_three_corrections():
    assert IS_CORRECTIONS.names() == ["mis", "none", "tis"]


def test_none_weighs_every_loss_token_one():
    weights, stats = weights_of("none")
    assert_close_to(weights, [[1, 1, 1, 1], [1, 1, 1, 0]])
    assert float(stats["is_weight_sum"]) == 7 and float(stats["is_masked_tokens"]) == 0


def test_tis_truncates_the_token_ratios_at_the_cap():
    # C = 2: the two 3.0 ratios become 2; the rest keep their ratio (no lower truncation, Yao et al.)
    weights, stats = weights_of("tis", cap=2.0)
    assert_close_to(weights, [[0.25, 0.8, 1.5, 2.0], [1.0, 2.0, 0.25, 0.0]])
    assert_close_to(stats["is_weight_sum"], 0.25 + 0.8 + 1.5 + 2.0 + 1.0 + 2.0 + 0.25)  # 7.8
    assert float(stats["is_truncated_tokens"]) == 2 and float(stats["is_masked_tokens"]) == 0
    assert not weights.isnan().any()


def test_tis_without_a_cap_is_plain_importance_sampling():
    weights, stats = weights_of("tis", cap=math.inf)
    assert_close_to(weights, [[0.25, 0.8, 1.5, 3.0], [1.0, 3.0, 0.25, 0.0]])
    assert float(stats["is_truncated_tokens"]) == 0


def test_tis_at_sequence_level_weighs_each_completion_by_its_product():
    assert_close_to(weights_of("tis", cap=2.0, level="sequence")[0], [[0.9] * 4, [0.75] * 3 + [0.0]])
    # C = 1 is still above both products: nothing truncated. Row 0 times 4/3 (product 1.2) would be.
    heavier = TRAIN.clone()
    heavier[0, 0] = ln(0.2 * 4 / 3)
    weights, stats = IS_CORRECTIONS.get("tis")(heavier, BEHAVIOUR, MASK, cap=1.0, level="sequence")
    assert_close_to(weights, [[1.0] * 4, [0.75] * 3 + [0.0]])
    assert float(stats["is_truncated_tokens"]) == 4  # all four tokens of row 0


def test_mis_masks_exactly_the_tokens_outside_the_band():
    # band [0.5, 2]: 0.25 and 3.0 are outside (four tokens), 0.8, 1.5 and 1.0 keep their ratio as weight
    weights, stats = weights_of("mis", low=0.5, high=2.0)
    assert_close_to(weights, [[0.0, 0.8, 1.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    outside = torch.tensor([[True, False, False, True], [False, True, True, False]])
    assert torch.equal(weights == 0, outside | ~MASK)
    assert float(stats["is_masked_tokens"]) == 4 and float(stats["is_truncated_tokens"]) == 0
    assert_close_to(stats["is_weight_sum"], 0.8 + 1.5 + 1.0)
    # the band is closed: [1, 1] keeps exactly the token whose ratio is exactly 1 (row 1's first, 0.5 / 0.5)
    assert_close_to(weights_of("mis", low=1.0, high=1.0)[0], [[0.0] * 4, [1.0, 0.0, 0.0, 0.0]])


def test_mis_at_sequence_level_masks_whole_completions():
    # band [0.8, 1.25]: row 0's product 0.9 is inside (every token weighs 0.9), row 1's 0.75 is not
    weights, stats = weights_of("mis", low=0.8, high=1.25, level="sequence")
    assert_close_to(weights, [[0.9] * 4, [0.0] * 4])
    assert float(stats["is_masked_tokens"]) == 3


@pytest.mark.parametrize(("name", "options", "message"), [
    ("tis", {"cap": 0.5}, "cap C must be >= 1"),
    ("mis", {"low": 1.2, "high": 2.0}, "must hold 1"),
    ("mis", {"low": 0.5, "high": 0.9}, "must hold 1"),
    ("tis", {"level": "geometric"}, "must be one of token, sequence"),
])
def test_bad_settings_are_refused(name, options, message):
    with pytest.raises(ValueError, match=message):
        weights_of(name, **options)


def test_the_weights_carry_no_gradient():
    train = TRAIN.clone().requires_grad_(True)
    weights, _ = IS_CORRECTIONS.get("tis")(train, BEHAVIOUR, MASK, cap=2.0)
    assert not weights.requires_grad


# --- inside rl_token_loss -----------------------------------------------------------------------------------

ADVANTAGES = torch.tensor([1.0, -2.0], dtype=F64)


def loss_of(logprobs, **options):
    return rl_token_loss(logprobs, TRAIN, ADVANTAGES, MASK, behaviour_logprobs=BEHAVIOUR, **options)


def test_tis_scales_the_policy_term_token_by_token():
    # First update after sampling: log π_θ = log π_old, ratio r = 1, so the clipped term is −A and the TIS
    # loss is −w·A: row 0 (A = 1): −0.25, −0.8, −1.5, −2.0; row 1 (A = −2): +2, +4, +0.5, 0 (padding).
    logprobs = torch.nan_to_num(TRAIN, nan=0.0).requires_grad_(True)
    per_token, stats = loss_of(logprobs, is_correction="tis", is_cap=2.0)
    assert_close_to(per_token, [[-0.25, -0.8, -1.5, -2.0], [2.0, 4.0, 0.5, 0.0]])
    # and its gradient: ∂ℓ/∂log π = −w·A·r = −w·A at r = 1
    per_token.sum().backward()
    assert_close_to(logprobs.grad, [[-0.25, -0.8, -1.5, -2.0], [2.0, 4.0, 0.5, 0.0]])
    assert float(stats["is_truncated_tokens"]) == 2


def test_tis_without_a_cap_equals_no_correction_where_the_clip_does_not_bind():
    # none: ℓ = −(π_θ/μ)·A. tis, C = ∞: ℓ = −(π_old/μ)·(π_θ/π_old)·A = −(π_θ/μ)·A — the same value and
    # gradient wherever neither clip binds (here: a clip range no ratio reaches).
    logprobs = (torch.nan_to_num(TRAIN, nan=0.0) + torch.tensor([[0.1, -0.2, 0.05, 0.0], [-0.1, 0.3, 0.2, 0.0]],
                                                                 dtype=F64)).requires_grad_(True)
    wide = {"clip_low": 0.99, "clip_high": 100.0}
    corrected, _ = loss_of(logprobs, is_correction="tis", is_cap=math.inf, **wide)
    (grad_corrected,) = torch.autograd.grad(corrected.sum(), logprobs)
    plain, _ = rl_token_loss(logprobs, BEHAVIOUR, ADVANTAGES, MASK, **wide)  # old = the sampler's, no weights
    (grad_plain,) = torch.autograd.grad(plain.sum(), logprobs)
    assert_close_to(corrected, plain.detach(), atol=1e-12)
    assert_close_to(grad_corrected, grad_plain, atol=1e-12)


def test_without_a_mismatch_every_correction_is_exactly_no_correction():
    # π_old = μ: every ρ is exactly 1, so tis (C >= 1) and mis (band holding 1) change nothing, bit for bit
    logprobs = torch.nan_to_num(BEHAVIOUR, nan=0.0) + 0.3
    plain, _ = rl_token_loss(logprobs, BEHAVIOUR, ADVANTAGES, MASK)
    for options in ({"is_correction": "tis", "is_cap": 1.0}, {"is_correction": "mis", "is_band": (0.5, 2.0)},
                    {"is_correction": "tis", "is_cap": 2.0, "is_level": "sequence"}):
        corrected, _ = rl_token_loss(logprobs, BEHAVIOUR, ADVANTAGES, MASK, behaviour_logprobs=BEHAVIOUR, **options)
        assert torch.equal(corrected, plain), options


def test_the_kl_term_is_not_reweighed():
    # mis [0.5, 2] zeroes the policy term of tokens 0 and 3 of row 0; their KL term (k1 = log π − log π_ref,
    # here 0.5 on every token, β = 0.1 → 0.05) stays
    logprobs = torch.nan_to_num(TRAIN, nan=0.0)
    per_token, _ = loss_of(logprobs, is_correction="mis", is_band=(0.5, 2.0), kl_beta=0.1,
                           ref_logprobs=logprobs - 0.5, kl_estimator="k1")
    assert_close_to(per_token[0], [0.05, -0.8 + 0.05, -1.5 + 0.05, 0.05])


def test_a_correction_without_the_samplers_logprobs_is_refused():
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        rl_token_loss(TRAIN, TRAIN, ADVANTAGES, MASK, is_correction="tis")


def test_mismatch_figures_by_hand():
    # |Δ| over the three tokens: 0.1, 0.2, 0.3 → mean 0.2, max 0.3; ratios e^{0.1}, e^{-0.2}, e^{0.3}
    figures = mismatch_figures([[-1.0, -2.2], [-0.7]], [[-1.1, -2.0], [-1.0]])
    assert figures["rollout/logprob_abs_diff"] == pytest.approx(0.2, abs=1e-12)
    assert figures["rollout/logprob_abs_diff_max"] == pytest.approx(0.3, abs=1e-12)
    assert figures["rollout/is_ratio_max"] == pytest.approx(math.exp(0.3), abs=1e-12)
    assert figures["rollout/is_ratio_min"] == pytest.approx(math.exp(-0.2), abs=1e-12)
    assert mismatch_figures([], []) == {}
