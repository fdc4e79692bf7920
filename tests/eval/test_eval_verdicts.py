"""`eval compare` verdicts agree with themselves: the interval, the p-value and the words tell one story.

For every delta the comparison reports, its interval excludes 0 exactly when it is called significant,
and a test that cannot reach significance with the items it has says "too few items to tell" instead
of a verdict. The two cases quoted in issue #11 are reproduced item for item.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from posttrain.eval.stats import compare_results

CI_IN_LINE = re.compile(r"CI[^\[]*\[([+-]?[\d.e-]+), ([+-]?[\d.e-]+)\]")


def results(groups: dict[str, list[float]], tiers: dict[str, list[int]] | None = None) -> dict:
    items = []
    for group, scores in groups.items():
        for index, score in enumerate(scores):
            tier = tiers[group][index] if tiers else 1
            items.append({"id": f"{group}-{index}", "group": group, "tier": tier, "score": float(score)})
    return {"items": items, "weights": {}}


def blocks(comparison: dict) -> list[tuple[str, dict]]:
    named = [("composite index", comparison["composite"])]
    named += [(f"group {g}", t) for g, t in comparison["groups"].items()]
    named += [(f"tier {k}", t) for k, t in comparison["tiers"].items()]
    return named


def line_of(comparison: dict, name: str) -> str:
    return next(line for line in comparison["summary"] if line.startswith(f"{name}:"))


def assert_self_consistent(comparison: dict) -> None:
    """Numbers and words agree for every block: 0 outside the interval <=> significant <=> the words say so."""
    for name, block in blocks(comparison):
        excludes_zero = block["ci_low"] > 0 or block["ci_high"] < 0
        assert excludes_zero == block["significant"], (name, block)
        assert block["ci_low"] <= block["delta"] <= block["ci_high"], (name, block)
        line = line_of(comparison, name)
        printed_low, printed_high = (float(x) for x in CI_IN_LINE.search(line).groups())
        assert printed_low == pytest.approx(block["ci_low"], abs=0.051)
        assert printed_high == pytest.approx(block["ci_high"], abs=0.051)
        assert ("a significant" in line) == block["significant"], line
        if not block["significant"]:
            assert "consistent with no change" in line or "too few items to tell" in line \
                or "no change on any item" in line, line


def test_quoted_tiny_suite_one_math_item_is_too_few_to_tell():
    # issue #11: "group math: 0.0 -> 100.0 (+100.0 points, 95% CI [+100.0, +100.0], p=1.0000 Holm-adjusted):
    # not significant" on a small suite: one math item that went from wrong to right.
    base = results({"math": [0], "words": [1, 0, 0], "code": [1, 1]})
    new = results({"math": [1], "words": [1, 1, 0], "code": [1, 0]})
    comparison = compare_results(base, new, n_perm=2000)
    assert_self_consistent(comparison)
    math = comparison["groups"]["math"]
    assert math["delta"] == pytest.approx(100.0) and not math["significant"]
    assert math["ci_low"] <= 0 <= math["ci_high"]  # one item cannot pin down a change
    line = line_of(comparison, "group math")
    assert "too few items to tell" in line
    assert "one item" in line  # the degenerate-interval warning
    assert "0.0 -> 100.0" in line and "95% CI [+100.0, +100.0]" not in line


def test_quoted_demo_reasoning_case_has_no_interval_that_excludes_zero_beside_not_significant():
    # issue #11: the demo report's "reasoning: +4.2, 95% CI [+1.6, +8.3], p=0.0670 Holm-adjusted: not
    # significant": 5 of 120 reasoning items fixed and none broken, beside two other groups of 120.
    rng = np.random.default_rng(3)
    following = (rng.random(120) < 0.5).astype(float)
    following_new = following.copy()
    following_new[np.flatnonzero(following == 0)[:24]] = 1.0  # +20 points: clearly real
    reasoning = np.zeros(120)
    reasoning_new = reasoning.copy()
    reasoning_new[:5] = 1.0
    transformation = (rng.random(120) < 0.1).astype(float)
    base = results({"instruction_following": following, "reasoning": reasoning, "transformation": transformation})
    new = results({"instruction_following": following_new, "reasoning": reasoning_new,
                   "transformation": transformation})
    comparison = compare_results(base, new, n_perm=5000)
    assert_self_consistent(comparison)
    group = comparison["groups"]["reasoning"]
    assert group["delta"] == pytest.approx(500 / 120)
    assert group["ci_low"] <= 0 < group["ci_high"] and not group["significant"]
    assert "too few items to tell" in line_of(comparison, "group reasoning")
    assert comparison["groups"]["instruction_following"]["significant"]
    assert comparison["composite"]["significant"]


@pytest.mark.parametrize("seed", range(24))
def test_verdicts_agree_on_tiny_to_large_random_suites(seed):
    rng = np.random.default_rng(seed)
    sizes = [1, 2, 3, 5, 8, 13, 40, 150, 400]
    groups, new_groups, tiers = {}, {}, {}
    for index in range(int(rng.integers(1, 4))):
        n = int(rng.choice(sizes))
        partial = rng.random() < 0.4  # IFEval-style partial credit: scores like 1/3, 2/3
        levels = np.array([0, 1 / 3, 2 / 3, 1]) if partial else np.array([0.0, 1.0])
        base = rng.choice(levels, size=n)
        change = rng.random(n) < rng.choice([0.0, 0.05, 0.3, 1.0])
        shift = rng.choice([-0.5, 0.0, 0.4])
        new = np.where(change, np.clip(base + shift + rng.normal(0, 0.5, n), 0, 1), base)
        new = levels[np.abs(new[:, None] - levels[None, :]).argmin(axis=1)]
        groups[f"g{index}"], new_groups[f"g{index}"] = base, new
        tiers[f"g{index}"] = rng.integers(1, 4, size=n).tolist()
    comparison = compare_results(results(groups, tiers), results(new_groups, tiers), n_perm=2000, seed=seed)
    assert_self_consistent(comparison)


def test_large_real_effect_is_significant_with_an_interval_that_covers_it():
    rng = np.random.default_rng(11)
    base = (rng.random(1200) < 0.5).astype(float)
    new = base.copy()
    new[np.flatnonzero(base == 0)[:120]] = 1.0  # +10 points
    comparison = compare_results(results({"g": base}), results({"g": new}), n_perm=4000)
    assert_self_consistent(comparison)
    composite = comparison["composite"]
    assert composite["significant"] and composite["delta"] == pytest.approx(10.0)
    assert 5.0 < composite["ci_low"] < 10.0 < composite["ci_high"] < 15.0


@pytest.mark.parametrize(("changed", "groups", "significant"), [(5, 1, False), (6, 1, True), (6, 3, False),
                                                                (7, 3, True)])
def test_too_few_items_to_tell_below_the_smallest_n_that_can_reach_significance(changed, groups, significant):
    # Exact sign-flip test: with k changed items the smallest two-sided p is 2 / 2**k; Bonferroni over m
    # groups tests each at alpha / m. 2/32 > 0.05, 2/64 <= 0.05; 3 * 2/64 > 0.05, 3 * 2/128 <= 0.05.
    base = {f"g{i}": [0.0] * 12 for i in range(groups)}
    new = {f"g{i}": [1.0] * changed + [0.0] * (12 - changed) for i in range(groups)}
    comparison = compare_results(results(base), results(new), n_perm=2000)
    assert_self_consistent(comparison)
    block = comparison["groups"]["g0"]
    assert block["significant"] == significant
    assert block["p_value"] == pytest.approx(2 / 2**changed)  # exact: 12 items, every sign pattern
    assert block["p_adjusted"] == pytest.approx(min(1.0, groups * 2 / 2**changed))
    assert ("too few items to tell" in line_of(comparison, "group g0")) == (not significant)


def test_degenerate_intervals_are_flagged():
    # Zero variance: every item moved by exactly +100 points; the interval has no width to speak of.
    comparison = compare_results(results({"g": [0.0] * 10}), results({"g": [1.0] * 10}), n_perm=2000)
    assert_self_consistent(comparison)
    composite = comparison["composite"]
    assert composite["significant"] and composite["ci_low"] == composite["ci_high"] == pytest.approx(100.0)
    assert any("zero width" in warning for warning in composite["warnings"])
    assert "zero width" in line_of(comparison, "composite index")
    # A test of one item.
    single = compare_results(results({"g": [0.0]}), results({"g": [1.0]}), n_perm=200)
    assert any("one item" in warning for warning in single["composite"]["warnings"])


def test_identical_runs_say_no_change_on_any_item():
    base = results({"a": [1, 0, 1, 1] * 10, "b": [0, 1] * 20})
    comparison = compare_results(base, base, n_perm=1000)
    assert_self_consistent(comparison)
    assert comparison["composite"]["p_value"] == 1.0
    assert "no change on any item" in line_of(comparison, "composite index")
