"""Statistics for scores that mean something: capability scores with bootstrap confidence intervals, a
weighted composite index, and paired comparisons of two runs.

Definitions (scores are on 0-100):

- capability score of group g: ``S_g = 100 * mean(score_i for items i in g)``;
- composite index: ``C = sum_g w_g S_g`` with the suite's weights normalised over the groups present
  (equal weights when the suite gives none);
- 95% CI: percentile bootstrap (Efron & Tibshirani 1993, ch. 13). Items are resampled with replacement
  *within each group* (a stratified bootstrap), so every replicate keeps the suite's group sizes and the
  composite's weights stay meaningful;
- comparison of BASE and NEW on the same items (paired by id): delta ``D_g = S_g(new) - S_g(base)``;
  CI by the paired bootstrap (resample item pairs within groups); two-sided p-value by a paired
  permutation (sign-flip) test: under H0 "no difference" each pair's difference ``d_i`` is equally likely
  to have either sign, so ``p = (1 + #{|T*| >= |T|}) / (1 + n_perm)`` over random sign flips
  (Good 2005, "Permutation, Parametric and Bootstrap Tests of Hypotheses", §3). Group and tier p-values
  are also Holm-adjusted (Holm 1979) within their family, and a group/tier change is called significant
  only when its adjusted p < alpha; the composite is the one primary test and uses its raw p.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

UNSPECIFIED_TIER = "unspecified"


def percentile_ci(replicates: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(replicates, [alpha, 1.0 - alpha])
    return float(low), float(high)


def bootstrap_means(values: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` means of resamples (with replacement, same size) of ``values``: shape ``(n_boot,)``."""
    if values.size == 0:
        return np.zeros(n_boot)
    index = rng.integers(0, values.size, size=(n_boot, values.size))
    return values[index].mean(axis=1)


def effective_weights(groups: list[str], suite_weights: dict[str, float] | None) -> dict[str, float]:
    """Composite weights over ``groups``: the suite's weights renormalised to sum to 1 (equal when none).

    A group the suite gives no weight gets weight 0; if that leaves nothing, weights fall back to equal.
    """
    groups = sorted(set(groups))
    if not groups:
        return {}
    raw = {g: float((suite_weights or {}).get(g, 0.0)) for g in groups} if suite_weights else {g: 1.0 for g in groups}
    total = sum(raw.values())
    if total <= 0:
        raw, total = {g: 1.0 for g in groups}, float(len(groups))
    return {g: w / total for g, w in raw.items()}


def _tier_key(tier: Any) -> str:
    return UNSPECIFIED_TIER if tier is None else str(tier)


def _partition(items: list[dict], key: str) -> dict[str, np.ndarray]:
    parts: dict[str, list[float]] = defaultdict(list)
    for item in items:
        label = _tier_key(item.get("tier")) if key == "tier" else str(item.get(key) or "default")
        parts[label].append(float(item["score"]))
    return {label: np.asarray(values, dtype=np.float64) for label, values in sorted(parts.items())}


def capability_scores(
    items: list[dict],
    weights: dict[str, float] | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Scores per group and per tier, and the composite index, each with a bootstrap CI.

    ``items``: dicts with ``score`` (0..1), ``group`` and ``tier``. ``weights``: the suite's group weights.
    Returns ``{"groups": {g: {score, ci_low, ci_high, n}}, "tiers": {...}, "composite": {score, ci_low,
    ci_high}, "weights": effective weights}``.
    """
    rng = np.random.default_rng(seed)
    groups = _partition(items, "group")
    tiers = _partition(items, "tier")
    used = effective_weights(list(groups), weights)
    result: dict[str, Any] = {"groups": {}, "tiers": {}, "weights": used}
    composite_reps = np.zeros(n_boot)
    composite = 0.0
    for name, values in groups.items():
        reps = bootstrap_means(values, n_boot, rng) * 100
        low, high = percentile_ci(reps, confidence)
        score = float(values.mean() * 100)
        result["groups"][name] = {"score": score, "ci_low": low, "ci_high": high, "n": int(values.size)}
        composite += used[name] * score
        composite_reps += used[name] * reps
    for name, values in tiers.items():
        reps = bootstrap_means(values, n_boot, rng) * 100
        low, high = percentile_ci(reps, confidence)
        result["tiers"][name] = {"score": float(values.mean() * 100), "ci_low": low, "ci_high": high,
                                 "n": int(values.size)}
    low, high = percentile_ci(composite_reps, confidence) if groups else (0.0, 0.0)
    result["composite"] = {"score": composite, "ci_low": low, "ci_high": high, "n": len(items)}
    return result


def holm_adjust(p_values: dict[str, float]) -> dict[str, float]:
    """Holm-Bonferroni step-down adjusted p-values: ``p_(k) * (m - k + 1)``, made monotone, capped at 1."""
    ordered = sorted(p_values.items(), key=lambda kv: kv[1])
    m = len(ordered)
    adjusted, running = {}, 0.0
    for rank, (name, p) in enumerate(ordered):
        running = max(running, min(1.0, p * (m - rank)))
        adjusted[name] = running
    return adjusted


def _paired_test(
    diffs_by_stratum: dict[str, np.ndarray],
    weights: dict[str, float],
    n_boot: int,
    n_perm: int,
    rng: np.random.Generator,
    confidence: float,
) -> dict[str, float]:
    """Delta (points), paired-bootstrap CI and sign-flip p-value of ``sum_s w_s * 100 * mean(d in s)``."""
    observed = sum(weights[s] * d.mean() * 100 for s, d in diffs_by_stratum.items())
    boot = np.zeros(n_boot)
    perm = np.zeros(n_perm)
    for stratum, d in diffs_by_stratum.items():
        boot += weights[stratum] * bootstrap_means(d, n_boot, rng) * 100
        for start in range(0, n_perm, 1000):
            count = min(1000, n_perm - start)
            signs = rng.integers(0, 2, size=(count, d.size), dtype=np.int8) * 2 - 1
            perm[start : start + count] += weights[stratum] * (signs * d).mean(axis=1) * 100
    low, high = percentile_ci(boot, confidence)
    # A tolerance so that float noise in identical statistics counts as "as extreme".
    extreme = np.abs(perm) >= abs(observed) - 1e-9
    p_value = float((1 + extreme.sum()) / (1 + n_perm))
    return {"delta": float(observed), "ci_low": low, "ci_high": high, "p_value": p_value}


def compare_results(
    base: dict,
    new: dict,
    n_boot: int = 2000,
    n_perm: int = 10000,
    seed: int = 0,
    alpha: float = 0.05,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Pair two ``posttrain eval`` results by item id and test every change. See the module docstring.

    Returns ``{"composite": {...}, "groups": {g: {...}}, "tiers": {...}, "paired": n, "only_in_base": [...],
    "only_in_new": [...], "weights": {...}, "alpha": alpha, "summary": [plain-language lines]}``, where each
    ``{...}`` has ``base, new, delta, ci_low, ci_high, p_value, significant`` (and ``p_holm`` for groups/tiers).
    """
    rng = np.random.default_rng(seed)
    base_items = {item["id"]: item for item in base["items"]}
    new_items = {item["id"]: item for item in new["items"]}
    common = [i for i in base_items if i in new_items]
    if not common:
        raise ValueError("the two results share no item ids: nothing to compare (were they run on the same suite?)")
    pairs = [(base_items[i], new_items[i]) for i in common]

    def strata(key: str) -> dict[str, np.ndarray]:
        out: dict[str, list[float]] = defaultdict(list)
        for b, n in pairs:
            label = _tier_key(b.get("tier")) if key == "tier" else str(b.get("group") or "default")
            out[label].append(float(n["score"]) - float(b["score"]))
        return {k: np.asarray(v) for k, v in sorted(out.items())}

    def mean_score(which: int, key: str, label: str) -> float:
        chosen = [p[which]["score"] for p in pairs
                  if (_tier_key(p[0].get("tier")) if key == "tier" else str(p[0].get("group") or "default")) == label]
        return float(np.mean(chosen) * 100)

    group_diffs, tier_diffs = strata("group"), strata("tier")
    weights = effective_weights(list(group_diffs), base.get("weights") or new.get("weights"))
    result: dict[str, Any] = {"paired": len(common), "alpha": alpha, "weights": weights,
                              "only_in_base": sorted(set(base_items) - set(new_items)),
                              "only_in_new": sorted(set(new_items) - set(base_items))}
    composite = _paired_test(group_diffs, weights, n_boot, n_perm, rng, confidence)
    composite["base"] = sum(weights[g] * mean_score(0, "group", g) for g in group_diffs)
    composite["new"] = sum(weights[g] * mean_score(1, "group", g) for g in group_diffs)
    composite["significant"] = composite["p_value"] < alpha
    result["composite"] = composite
    for key, diffs in (("groups", group_diffs), ("tiers", tier_diffs)):
        family = {}
        for label, d in diffs.items():
            test = _paired_test({label: d}, {label: 1.0}, n_boot, n_perm, rng, confidence)
            test["base"] = mean_score(0, key[:-1], label)
            test["new"] = mean_score(1, key[:-1], label)
            test["n"] = int(d.size)
            family[label] = test
        adjusted = holm_adjust({label: t["p_value"] for label, t in family.items()})
        for label, test in family.items():
            test["p_holm"] = adjusted[label]
            test["significant"] = adjusted[label] < alpha
        result[key] = family
    result["summary"] = summarize_comparison(result)
    return result


def _describe(name: str, test: dict, alpha: float, adjusted: bool) -> str:
    p = test.get("p_holm", test["p_value"]) if adjusted else test["p_value"]
    numbers = (f"{test['base']:.1f} -> {test['new']:.1f} ({test['delta']:+.1f} points, 95% CI "
               f"[{test['ci_low']:+.1f}, {test['ci_high']:+.1f}], p={p:.4f}{' Holm-adjusted' if adjusted else ''})")
    if test["significant"]:
        direction = "a significant improvement" if test["delta"] > 0 else "a significant regression"
        verdict = f"{direction} at the {alpha:g} level"
    elif test["delta"] == 0 and test["ci_low"] == 0 == test["ci_high"]:
        verdict = "no change on any item"
    else:
        verdict = "not significant: consistent with no change"
    return f"{name}: {numbers}: {verdict}."


def summarize_comparison(result: dict) -> list[str]:
    """Plain-language lines: the composite first, then every group and tier."""
    alpha = result["alpha"]
    lines = [_describe("composite index", result["composite"], alpha, adjusted=False)]
    lines += [_describe(f"group {g}", t, alpha, adjusted=True) for g, t in result["groups"].items()]
    lines += [_describe(f"tier {k}", t, alpha, adjusted=True) for k, t in result["tiers"].items()]
    significant = [g for g, t in result["groups"].items() if t["significant"]]
    if result["composite"]["significant"] or significant:
        lines.append("Significant changes: " + ", ".join(
            (["composite index"] if result["composite"]["significant"] else []) + [f"group {g}" for g in significant]
        ) + ".")
    else:
        lines.append("No change is statistically significant; differences of this size can arise from item sampling alone.")
    dropped = len(result["only_in_base"]) + len(result["only_in_new"])
    if dropped:
        lines.append(f"Compared {result['paired']} items present in both runs; {len(result['only_in_base'])} only in "
                     f"BASE and {len(result['only_in_new'])} only in NEW were left out of the comparison.")
    return lines
