"""Statistics on synthetic results whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.eval.pairing import IncomparableResults
from posttrain.eval.permutation import items_needed, sign_flip_test, sign_flips, smallest_p
from posttrain.eval.stats import capability_scores, compare_results, effective_weights


def run(scores_by_group: dict[str, list[float]], tiers: list[int] | None = None, weights=None) -> dict:
    items, index = [], 0
    for group, scores in scores_by_group.items():
        for score in scores:
            tier = tiers[index] if tiers else 1
            items.append({"id": f"{group}-{index}", "group": group, "tier": tier, "score": score})
            index += 1
    return {"items": items, "weights": weights or {}}


def test_scores_and_composite_on_known_values():
    data = run({"a": [1, 1, 0, 0], "b": [1, 1, 1, 1, 1, 1, 1, 0]})
    out = capability_scores(data["items"], {"a": 3.0, "b": 1.0}, n_boot=500)
    assert out["groups"]["a"]["score"] == pytest.approx(50.0)
    assert out["groups"]["b"]["score"] == pytest.approx(87.5)
    assert out["composite"]["score"] == pytest.approx(0.75 * 50 + 0.25 * 87.5)
    for block in (*out["groups"].values(), out["composite"]):
        assert block["ci_low"] <= block["score"] <= block["ci_high"]
    assert out["weights"] == {"a": 0.75, "b": 0.25}


def test_constant_scores_have_zero_width_ci():
    out = capability_scores(run({"a": [1.0] * 10})["items"], n_boot=200)
    assert out["groups"]["a"] == {"score": 100.0, "ci_low": 100.0, "ci_high": 100.0, "n": 10}


def test_tiers_and_unspecified_tier():
    items = [{"id": "1", "group": "g", "tier": 1, "score": 1.0}, {"id": "2", "group": "g", "tier": None, "score": 0.0}]
    out = capability_scores(items, n_boot=100)
    assert out["tiers"]["1"]["score"] == 100.0 and out["tiers"]["unspecified"]["score"] == 0.0


def test_effective_weights():
    assert effective_weights(["a", "b"], {}) == {"a": 0.5, "b": 0.5}
    assert effective_weights(["a", "b"], {"a": 1, "b": 3, "c": 10}) == {"a": 0.25, "b": 0.75}
    assert effective_weights(["a", "z"], {"a": 2}) == {"a": 1.0, "z": 0.0}
    assert effective_weights(["x"], {"a": 1}) == {"x": 1.0}


def test_bootstrap_ci_covers_the_true_mean_about_95_percent():
    rng = np.random.default_rng(1)
    true_p, hits, trials = 0.6, 0, 200
    for trial in range(trials):
        scores = (rng.random(80) < true_p).astype(float).tolist()
        g = capability_scores(run({"g": scores})["items"], n_boot=400, seed=trial)["groups"]["g"]
        hits += g["ci_low"] <= true_p * 100 <= g["ci_high"]
    assert 0.88 <= hits / trials <= 0.99


def test_identical_runs_have_zero_delta_and_no_significance():
    rng = np.random.default_rng(0)
    base = run({"a": (rng.random(60) < 0.5).astype(float).tolist(), "b": (rng.random(40) < 0.7).astype(float).tolist()})
    out = compare_results(base, base, n_perm=2000)
    assert out["composite"]["delta"] == 0.0
    assert out["composite"]["ci_low"] <= 0.0 <= out["composite"]["ci_high"]
    assert out["composite"]["p_value"] == 1.0 and not out["composite"]["significant"]
    assert not any(t["significant"] for t in out["groups"].values())
    assert any(line.startswith("No change is statistically significant") for line in out["summary"])


def test_fixing_30_of_100_items_is_significant():
    base_scores = [0.0] * 60 + [1.0] * 40
    new_scores = [1.0] * 30 + [0.0] * 30 + [1.0] * 40
    out = compare_results(run({"g": base_scores}), run({"g": new_scores}), n_perm=5000)
    composite = out["composite"]
    assert composite["delta"] == pytest.approx(30.0)
    assert composite["base"] == pytest.approx(40.0) and composite["new"] == pytest.approx(70.0)
    assert composite["ci_low"] > 0 and composite["p_value"] < 0.001 and composite["significant"]
    assert out["groups"]["g"]["significant"]
    assert "significant improvement" in out["summary"][0]


def test_a_small_mixed_change_is_not_significant():
    base_scores = [1.0, 0.0] * 50
    new_scores = list(base_scores)
    new_scores[1], new_scores[3], new_scores[0] = 1.0, 1.0, 0.0  # +2 -1 on 100 items
    out = compare_results(run({"g": base_scores}), run({"g": new_scores}), n_perm=5000)
    assert out["composite"]["delta"] == pytest.approx(1.0)
    assert out["composite"]["p_value"] > 0.5 and not out["composite"]["significant"]
    assert out["composite"]["ci_low"] < 0 < out["composite"]["ci_high"]


def test_regression_in_one_group_only():
    base = run({"up": [0.0] * 40, "same": [1.0] * 40, "down": [1.0] * 40}, weights={"up": 1, "same": 1, "down": 1})
    new = run({"up": [0.0] * 40, "same": [1.0] * 40, "down": [1.0] * 10 + [0.0] * 30})
    out = compare_results(base, new, n_perm=3000)
    assert out["groups"]["down"]["delta"] == pytest.approx(-75.0) and out["groups"]["down"]["significant"]
    assert not out["groups"]["same"]["significant"] and not out["groups"]["up"]["significant"]
    assert out["composite"]["delta"] == pytest.approx(-25.0) and out["composite"]["significant"]
    assert any("group down" in line and "significant regression" in line for line in out["summary"])


def test_items_are_paired_by_id_and_extras_reported():
    base = run({"g": [0.0, 1.0, 1.0]})
    new = {"items": list(reversed(run({"g": [0.0, 1.0, 1.0]})["items"])) + [{"id": "extra", "group": "g", "score": 1}]}
    out = compare_results(base, new, n_perm=500)
    assert out["paired"] == 3 and out["only_in_new"] == ["extra"] and out["composite"]["delta"] == 0.0
    with pytest.raises(IncomparableResults, match="share no item ids"):
        compare_results(base, {"items": [{"id": "zzz", "group": "g", "score": 1}]})


def test_exact_p_value_is_the_two_sided_sign_test():
    # 7 items fixed, 1 broken, 2 unchanged: conditional on the 8 that changed, the count fixed is
    # Binomial(8, 1/2) under H0, so p = P(X >= 7) + P(X <= 1) = (1 + 8 + 8 + 1) / 256.
    diffs = np.array([1.0] * 7 + [-1.0] + [0.0] * 2)
    signs, exact = sign_flips(diffs.size, 0, np.random.default_rng(0))
    test = sign_flip_test(diffs, np.full(diffs.size, 10.0), 0.05, signs, exact)
    assert exact and test.p_value == pytest.approx(18 / 256) and not test.rejected
    assert test.delta == pytest.approx(60.0) and test.n_changed == 8
    assert smallest_p(8) == pytest.approx(2 / 256) and smallest_p(0) == 1.0
    assert items_needed(0.05) == 6 and items_needed(0.05 / 3) == 7 and items_needed(0.01) == 8


def _p_by_definition(diffs, coefficients, signs, delta):
    """Monte Carlo sign-flip p-value of H0 "the differences are symmetric about delta", straight from its definition."""
    shifted = diffs - delta / 100
    observed = abs(coefficients @ shifted)
    flipped = np.abs(signs.astype(float) @ (coefficients * shifted))
    return (1 + np.count_nonzero(flipped >= observed - 1e-9)) / (1 + signs.shape[0])


@pytest.mark.parametrize("seed", range(4))
def test_interval_is_the_set_of_deltas_the_test_does_not_reject(seed):
    rng = np.random.default_rng(seed)
    diffs = rng.choice([-1, -2 / 3, -1 / 3, 0, 0, 0, 1 / 3, 2 / 3, 1], size=40)
    coefficients = np.full(diffs.size, 100 / diffs.size)
    level = [0.05, 0.05 / 3][seed % 2]
    signs, exact = sign_flips(diffs.size, 3000, rng)
    test = sign_flip_test(diffs, coefficients, level, signs, exact)
    assert not exact and test.ci_low < test.delta < test.ci_high
    assert test.p_value == pytest.approx(_p_by_definition(diffs, coefficients, signs, 0.0))
    for end, outward in ((test.ci_low, -1), (test.ci_high, 1)):
        assert _p_by_definition(diffs, coefficients, signs, end - outward * 1e-6) > level  # just inside
        assert _p_by_definition(diffs, coefficients, signs, end + outward * 1e-6) <= level  # just outside


def test_inverted_interval_covers_the_true_change_about_95_percent():
    # Paired right/wrong items: +1 with probability 0.10, -1 with 0.05: the true change is +5 points.
    rng = np.random.default_rng(5)
    hits, trials, n = 0, 200, 120
    for _ in range(trials):
        u = rng.random(n)
        diffs = np.where(u < 0.10, 1.0, np.where(u < 0.15, -1.0, 0.0))
        signs, exact = sign_flips(n, 2000, rng)
        test = sign_flip_test(diffs, np.full(n, 100 / n), 0.05, signs, exact)
        hits += test.ci_low <= 5.0 <= test.ci_high
    assert 0.90 <= hits / trials <= 0.99


def test_group_intervals_are_bonferroni_simultaneous():
    base = run({"a": [0.0] * 30, "b": [0.0] * 30, "c": [0.0] * 30, "d": [0.0] * 30})
    new = run({"a": [1.0] * 9 + [0.0] * 21, "b": [0.0] * 30, "c": [1.0] * 3 + [0.0] * 27, "d": [0.0] * 30})
    out = compare_results(base, new, n_perm=4000)
    for group in out["groups"].values():
        assert group["family_size"] == 4 and group["level"] == pytest.approx(0.0125)
        assert group["confidence"] == pytest.approx(1 - 0.05 / 4)
        assert group["p_adjusted"] == pytest.approx(min(1.0, 4 * group["p_value"]))
        assert group["significant"] == (group["p_adjusted"] <= 0.05)
    assert out["composite"]["family_size"] == 1 and out["composite"]["confidence"] == pytest.approx(0.95)
    assert out["groups"]["a"]["significant"] and not out["groups"]["c"]["significant"]


def test_items_with_the_same_id_but_other_content_are_left_out_and_reported():
    def row(item_id, prompt, answer, score, digest=True):
        entry = {"id": item_id, "group": "g", "tier": 1, "prompt": prompt, "answer": answer, "verifier": "exact",
                 "score": score}
        if digest:
            from posttrain.eval.items import content_hash
            entry["content_hash"] = content_hash(prompt, answer, None, "exact", {})
        return entry

    base = {"items": [row(f"q{i}", f"What is {i}+1?", str(i + 1), 0.0) for i in range(10)]}
    same = {"items": [row(f"q{i}", f"What is {i}+1?", str(i + 1), 1.0) for i in range(8)]
            + [row("q8", "What is 8*2?", "16", 1.0), row("q9", "What is 9+1?", "11", 1.0)]}
    out = compare_results(base, same, n_perm=1000)
    assert out["paired"] == 8 and out["changed_content"] == ["q8", "q9"] and out["checked_by"] == "content hash"
    assert any("2 items share an id but differ" in line and "q8, q9" in line for line in out["summary"])
    # Every shared id holds another question: nothing to compare (issue #11: +8.3 points from two suites).
    other = {"items": [row(f"q{i}", f"Spell {i} backwards", str(i)[::-1], 1.0) for i in range(10)]}
    with pytest.raises(IncomparableResults, match="all 10 item ids the two results share differ"):
        compare_results(base, other)
    # Older results store no hashes: the stored prompt and answer are compared instead, and the summary says so.
    old_base = {"items": [row(f"q{i}", f"What is {i}+1?", str(i + 1), 0.0, digest=False) for i in range(10)]}
    out = compare_results(old_base, same, n_perm=1000)
    assert out["checked_by"] == "stored prompt and answer" and out["changed_content"] == ["q8", "q9"]
    assert any("BASE holds no content hashes" in line for line in out["summary"])
