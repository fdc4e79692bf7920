"""Statistics on synthetic results whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.eval.stats import (
    capability_scores,
    compare_results,
    effective_weights,
    holm_adjust,
)


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
    out = compare_results(base, base, n_boot=500, n_perm=2000)
    assert out["composite"]["delta"] == 0.0
    assert out["composite"]["ci_low"] <= 0.0 <= out["composite"]["ci_high"]
    assert out["composite"]["p_value"] == 1.0 and not out["composite"]["significant"]
    assert not any(t["significant"] for t in out["groups"].values())
    assert "No change is statistically significant" in out["summary"][-1]


def test_fixing_30_of_100_items_is_significant():
    base_scores = [0.0] * 60 + [1.0] * 40
    new_scores = [1.0] * 30 + [0.0] * 30 + [1.0] * 40
    out = compare_results(run({"g": base_scores}), run({"g": new_scores}), n_boot=1000, n_perm=5000)
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
    out = compare_results(run({"g": base_scores}), run({"g": new_scores}), n_boot=1000, n_perm=5000)
    assert out["composite"]["delta"] == pytest.approx(1.0)
    assert out["composite"]["p_value"] > 0.5 and not out["composite"]["significant"]
    assert out["composite"]["ci_low"] < 0 < out["composite"]["ci_high"]


def test_regression_in_one_group_only():
    base = run({"up": [0.0] * 40, "same": [1.0] * 40, "down": [1.0] * 40}, weights={"up": 1, "same": 1, "down": 1})
    new = run({"up": [0.0] * 40, "same": [1.0] * 40, "down": [1.0] * 10 + [0.0] * 30})
    out = compare_results(base, new, n_boot=500, n_perm=3000)
    assert out["groups"]["down"]["delta"] == pytest.approx(-75.0) and out["groups"]["down"]["significant"]
    assert not out["groups"]["same"]["significant"] and not out["groups"]["up"]["significant"]
    assert out["composite"]["delta"] == pytest.approx(-25.0) and out["composite"]["significant"]
    assert any("group down" in line and "significant regression" in line for line in out["summary"])


def test_items_are_paired_by_id_and_extras_reported():
    base = run({"g": [0.0, 1.0, 1.0]})
    new = {"items": list(reversed(run({"g": [0.0, 1.0, 1.0]})["items"])) + [{"id": "extra", "group": "g", "score": 1}]}
    out = compare_results(base, new, n_boot=200, n_perm=500)
    assert out["paired"] == 3 and out["only_in_new"] == ["extra"] and out["composite"]["delta"] == 0.0
    with pytest.raises(ValueError, match="share no item ids"):
        compare_results(base, {"items": [{"id": "zzz", "group": "g", "score": 1}]})


def test_holm_adjust():
    adjusted = holm_adjust({"a": 0.01, "b": 0.04, "c": 0.03})
    assert adjusted == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
