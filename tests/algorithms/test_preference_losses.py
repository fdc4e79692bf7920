"""Each preference loss against its formula written out in plain ``math``, plus gradient signs."""

import math

import pytest
import torch

from posttrain.algorithms.preference import (
    LOSS_SPECS,
    LOSSES,
    chosen_sft_term,
    combine_losses,
    preference_metrics,
    update_running_mean,
)

# Three pairs: policy / reference log-prob sums and response lengths.
PC = [-10.0, -12.0, -5.0]
PR = [-11.0, -9.0, -7.0]
RC = [-10.5, -12.0, -6.0]
RR = [-10.0, -9.5, -6.5]
LC = [5.0, 6.0, 2.0]
LR = [4.0, 6.0, 3.0]
BETA = 0.5
EPS = 0.1


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def log_ratio_margin(i: int) -> float:
    return (PC[i] - RC[i]) - (PR[i] - RR[i])


def hand_sigmoid(i):
    return -logsig(BETA * log_ratio_margin(i))


def hand_cdpo(i):
    h = log_ratio_margin(i)
    return -(1 - EPS) * logsig(BETA * h) - EPS * logsig(-BETA * h)


def hand_robust(i):
    h = log_ratio_margin(i)
    return (-(1 - EPS) * logsig(BETA * h) + EPS * logsig(-BETA * h)) / (1 - 2 * EPS)


def hand_hinge(i):
    return max(0.0, 1 - BETA * log_ratio_margin(i))


def hand_ipo(i):
    normalised = (PC[i] - RC[i]) / LC[i] - (PR[i] - RR[i]) / LR[i]
    return (normalised - 1 / (2 * BETA)) ** 2


def hand_apo_zero(i):
    return (1 - sig(BETA * (PC[i] - RC[i]))) + sig(BETA * (PR[i] - RR[i]))


DELTA = 0.3


def hand_bco_pair(i):
    return -logsig(BETA * (PC[i] - RC[i]) - DELTA) - logsig(-(BETA * (PR[i] - RR[i]) - DELTA))


GAMMA = 0.7


def hand_simpo(i):
    return -logsig(BETA * PC[i] / LC[i] - BETA * PR[i] / LR[i] - GAMMA)


LAMBDA = 0.25


def hand_orpo(i):
    p_c, p_r = math.exp(PC[i] / LC[i]), math.exp(PR[i] / LR[i])
    log_odds_ratio = math.log(p_c / (1 - p_c)) - math.log(p_r / (1 - p_r))
    return -PC[i] / LC[i] - LAMBDA * logsig(log_odds_ratio)


HAND = {
    "sigmoid": hand_sigmoid,
    "cdpo": hand_cdpo,
    "robust": hand_robust,
    "hinge": hand_hinge,
    "ipo": hand_ipo,
    "apo_zero": hand_apo_zero,
    "bco_pair": hand_bco_pair,
    "simpo": hand_simpo,
    "orpo": hand_orpo,
}
PARAMS = {
    "beta": BETA,
    "label_smoothing": EPS,
    "bco_delta": DELTA,
    "simpo_gamma": GAMMA,
    "orpo_lambda": LAMBDA,
}


def t(values):
    return torch.tensor(values, dtype=torch.float32)


def call(name, pc=PC, pr=PR, rc=RC, rr=RR, **overrides):
    kwargs = {**PARAMS, "chosen_lengths": t(LC), "rejected_lengths": t(LR), **overrides}
    return LOSSES.get(name)(
        t(pc), t(pr), None if rc is None else t(rc), None if rr is None else t(rr), **kwargs
    )


def test_registry_holds_exactly_the_documented_losses():
    assert set(LOSSES) == set(HAND) == set(LOSS_SPECS)


@pytest.mark.parametrize("name", sorted(HAND))
def test_loss_matches_its_formula(name):
    got = call(name)
    assert got.dtype == torch.float32 and got.shape == (3,)
    assert got.tolist() == pytest.approx([HAND[name](i) for i in range(3)], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", sorted(HAND))
def test_one_sgd_step_on_policy_logps_widens_the_margin(name):
    # Margins near zero: inside the region where every loss (IPO, hinge included) still pushes up.
    pc = torch.tensor([-10.0, -12.0, -8.0], requires_grad=True)
    pr = torch.tensor([-10.0, -11.0, -8.5], requires_grad=True)
    ref_c, ref_r = t([-10.0, -11.5, -8.0]), t([-10.0, -11.0, -8.2])
    lengths = t([4.0, 5.0, 6.0])
    loss = LOSSES.get(name)(pc, pr, ref_c, ref_r, **PARAMS, chosen_lengths=lengths, rejected_lengths=lengths)
    before = (pc - pr).detach().clone()
    loss.sum().backward()
    with torch.no_grad():
        pc -= 0.1 * pc.grad
        pr -= 0.1 * pr.grad
    assert bool(((pc - pr) > before).all()), f"{name}: margin {before.tolist()} -> {(pc - pr).tolist()}"


def test_reference_free_losses_ignore_the_reference():
    free = sorted(n for n, spec in LOSS_SPECS.items() if not spec.needs_reference)
    assert free == ["orpo", "simpo"]
    for name in free:
        without = call(name, rc=None, rr=None)
        with_other = call(name, rc=[0.0, -100.0, 3.0], rr=[-50.0, 7.0, 0.0])
        assert torch.equal(without, with_other), name


def test_reference_losses_refuse_a_missing_reference():
    for name, spec in LOSS_SPECS.items():
        if spec.needs_reference:
            with pytest.raises(ValueError, match="needs reference log-probs"):
                call(name, rc=None, rr=None)


def test_length_normalised_losses_refuse_missing_lengths():
    needing = sorted(n for n, spec in LOSS_SPECS.items() if spec.needs_lengths)
    assert needing == ["ipo", "orpo", "simpo"]
    for name in needing:
        with pytest.raises(ValueError, match="chosen_lengths and rejected_lengths"):
            call(name, chosen_lengths=None)
        with pytest.raises(ValueError, match="at least 1 token"):
            call(name, chosen_lengths=t([5.0, 0.0, 2.0]))


def test_shape_mismatch_and_bad_smoothing_are_clear_errors():
    with pytest.raises(ValueError, match=r"ref_chosen_logps has shape \(2,\)"):
        LOSSES.get("sigmoid")(t(PC), t(PR), t(RC[:2]), t(RR), beta=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        call("robust", label_smoothing=0.5)


def test_orpo_stays_finite_at_extreme_likelihoods():
    loss = LOSSES.get("orpo")(
        t([0.0, -1e-9, -400.0]),
        t([-300.0, 0.0, -1e-3]),
        None,
        None,
        orpo_lambda=0.1,
        chosen_lengths=t([1.0, 2.0, 4.0]),
        rejected_lengths=t([3.0, 1.0, 1.0]),
    )
    assert bool(torch.isfinite(loss).all()), loss


def test_combine_losses_weights_each_term():
    weights = [0.3, 1.7]
    got = combine_losses(
        ["sigmoid", "ipo"],
        weights,
        t(PC),
        t(PR),
        t(RC),
        t(RR),
        beta=BETA,
        chosen_lengths=t(LC),
        rejected_lengths=t(LR),
    )
    expected = [0.3 * hand_sigmoid(i) + 1.7 * hand_ipo(i) for i in range(3)]
    assert got.tolist() == pytest.approx(expected, rel=1e-5)
    unweighted = combine_losses(["sigmoid", "hinge"], None, t(PC), t(PR), t(RC), t(RR), beta=BETA)
    assert unweighted.tolist() == pytest.approx([hand_sigmoid(i) + hand_hinge(i) for i in range(3)], rel=1e-5)


def test_combine_losses_rejects_bad_lists_and_unused_params():
    args = (t(PC), t(PR), t(RC), t(RR))
    with pytest.raises(ValueError, match="2 weights but dpo.loss names 1"):
        combine_losses(["sigmoid"], [0.5, 0.5], *args, beta=BETA)
    with pytest.raises(ValueError, match="at least one"):
        combine_losses([], None, *args, beta=BETA)
    with pytest.raises(LookupError, match="did you mean 'sigmoid'"):
        combine_losses(["sigmod"], None, *args, beta=BETA)
    with pytest.raises(ValueError, match="'simpo_gamma' is not used by sigmoid; it is read by simpo"):
        combine_losses(["sigmoid"], None, *args, beta=BETA, simpo_gamma=1.0)
    with pytest.raises(ValueError, match="no preference loss reads it"):
        combine_losses(["sigmoid"], None, *args, beta=BETA, simpo_gama=1.0)


def test_chosen_sft_term_is_weighted_per_token_nll():
    got = chosen_sft_term(t([10.0, 3.0]), t([5.0, 4.0]), sft_weight=0.2)
    assert got.tolist() == pytest.approx([0.2 * 10 / 5, 0.2 * 3 / 4])


def test_preference_metrics_hand_values():
    m = preference_metrics(
        t(PC), t(PR), t(RC), t(RR), beta=BETA, chosen_lengths=t(LC), rejected_lengths=t(LR)
    )
    reward_c = [BETA * (PC[i] - RC[i]) for i in range(3)]
    reward_r = [BETA * (PR[i] - RR[i]) for i in range(3)]
    margins = [c - r for c, r in zip(reward_c, reward_r, strict=True)]
    assert m["rewards/chosen"] == pytest.approx(sum(reward_c) / 3)
    assert m["rewards/rejected"] == pytest.approx(sum(reward_r) / 3)
    assert m["rewards/margin"] == pytest.approx(sum(margins) / 3)
    assert m["rewards/accuracy"] == pytest.approx(sum(x > 0 for x in margins) / 3)
    assert m["logps/chosen"] == pytest.approx(sum(PC) / 3)
    assert m["logps/rejected"] == pytest.approx(sum(PR) / 3)
    ratios = sum(PC[i] - RC[i] + PR[i] - RR[i] for i in range(3))
    assert m["kl_to_ref"] == pytest.approx(ratios / (sum(LC) + sum(LR)))


def test_preference_metrics_without_reference_use_length_normalised_rewards():
    m = preference_metrics(t(PC), t(PR), None, None, beta=BETA, chosen_lengths=t(LC), rejected_lengths=t(LR))
    assert "kl_to_ref" not in m
    assert m["rewards/chosen"] == pytest.approx(sum(BETA * PC[i] / LC[i] for i in range(3)) / 3)


def test_update_running_mean_equals_mean_of_everything_seen():
    mean, count = 0.0, 0
    seen = []
    for batch in ([1.0, 2.0], [], [10.0, -4.0, 3.0]):
        mean, count = update_running_mean(mean, count, t(batch))
        seen += batch
    assert count == len(seen) and mean == pytest.approx(sum(seen) / len(seen))
