"""Statistics for scores that mean something: capability scores with bootstrap confidence intervals, a
weighted composite index, and paired comparisons of two runs whose interval, p-value and words agree.

Definitions (scores are on 0-100):

- capability score of group g: ``S_g = 100 * mean(score_i for items i in g)``;
- composite index: ``C = sum_g w_g S_g`` with the suite's weights normalised over the groups present
  (equal weights when the suite gives none);
- 95% CI of one run's score: percentile bootstrap (Efron & Tibshirani 1993, ch. 13). Items are resampled
  with replacement *within each group* (a stratified bootstrap), so every replicate keeps the suite's
  group sizes and the composite's weights stay meaningful;
- comparison of BASE and NEW on the same items (``posttrain.eval.pairing``: same id and same content):
  delta ``D = sum_i c_i (new_i - base_i)`` in points, with ``c_i = 100 w_g / n_g`` for the composite and
  ``100 / n_g`` for a group or tier. Each delta gets an exact (or Monte Carlo) paired sign-flip
  permutation p-value and the confidence interval that inverts that same test
  (``posttrain.eval.permutation``), so the interval excludes 0 exactly when the test rejects.
- multiplicity: the composite is the one primary test, at level alpha. Groups are a family of m tests,
  and so are tiers; each member is tested at alpha / m and its interval is the 1 - alpha/m interval
  (Bonferroni; Dunn 1961, "Multiple comparisons among means", JASA 56:52). The m intervals then hold
  together with probability at least 1 - alpha (simultaneous), and the reported ``p_adjusted = min(1,
  m p)`` is <= alpha exactly when the interval excludes 0. Holm's step-down (Holm 1979) rejects a little
  more often, but its decisions have no simple simultaneous intervals that agree with them (Strassburger
  & Bretz 2008, Stat. Med. 27:4914), so a Holm verdict would again sit beside an interval that says
  otherwise;
- verdicts: "significant" iff p <= the test's level; "no change on any item" when no item changed;
  "too few items to tell" when even the most extreme outcome of the items that changed could not reach
  the level (``2 / 2^k > level`` for k changed items); otherwise "consistent with no change". Intervals
  from one item, or with zero width (every item changed by the same amount), carry a warning.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from posttrain.eval.pairing import IncomparableResults, pair_results
from posttrain.eval.permutation import SignFlipResult, items_needed, sign_flip_test, sign_flips

__all__ = ["IncomparableResults", "capability_scores", "compare_results", "effective_weights", "summarize_comparison"]

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


def _label(row: dict, key: str) -> str:
    return _tier_key(row.get("tier")) if key == "tier" else str(row.get("group") or "default")


def _block(test: SignFlipResult, base: float, new: float, family_size: int) -> dict[str, Any]:
    """One reported delta: the test's numbers, the scores either side, and the multiplicity it was judged at."""
    return {
        "base": base, "new": new, "delta": test.delta, "ci_low": test.ci_low, "ci_high": test.ci_high,
        "confidence": test.confidence, "p_value": test.p_value,
        "p_adjusted": min(1.0, test.p_value * family_size), "family_size": family_size, "level": test.level,
        "significant": test.rejected, "too_few_items": test.too_few_items, "exact": test.exact, "n": test.n,
        "n_changed": test.n_changed, "items_needed": items_needed(test.level), "warnings": list(test.warnings),
    }


def compare_results(
    base: dict,
    new: dict,
    n_perm: int = 10000,
    seed: int = 0,
    alpha: float = 0.05,
    n_boot: int | None = None,
) -> dict[str, Any]:
    """Pair two ``posttrain eval`` results by item id and content, and test every change. See the module docstring.

    ``n_boot`` is ignored (intervals now invert the permutation test); it is accepted so that callers
    written for the bootstrap interval keep working. Raises ``IncomparableResults`` when no item pairs.

    Returns ``{"composite": {...}, "groups": {g: {...}}, "tiers": {...}, "paired": n, "only_in_base": [...],
    "only_in_new": [...], "changed_content": [...], "checked_by": ..., "weights": {...}, "alpha": alpha,
    "summary": [plain-language lines]}``, where each ``{...}`` (``_block``) has ``base, new, delta, ci_low,
    ci_high, confidence, p_value, p_adjusted, family_size, level, significant, too_few_items, exact, n,
    n_changed, items_needed, warnings``.
    """
    del n_boot
    pairing = pair_results(base["items"], new["items"])
    rng = np.random.default_rng(seed)
    base_scores = np.array([float(b["score"]) for b, _ in pairing.pairs])
    new_scores = np.array([float(n["score"]) for _, n in pairing.pairs])
    diffs = new_scores - base_scores
    labels = {key: np.array([_label(b, key) for b, _ in pairing.pairs]) for key in ("group", "tier")}

    def test(coefficients: np.ndarray, level: float) -> SignFlipResult:
        signs, exact = sign_flips(int(np.count_nonzero(coefficients > 0)), n_perm, rng)
        return sign_flip_test(diffs, coefficients, level, signs, exact)

    groups = sorted(set(labels["group"]))
    weights = effective_weights(groups, base.get("weights") or new.get("weights"))
    # Composite: c_i = 100 w_g / n_g, so sum_i c_i d_i = sum_g w_g * 100 * mean(d in g).
    per_item = np.array([weights[g] for g in labels["group"]]) / np.array(
        [np.count_nonzero(labels["group"] == g) for g in labels["group"]]) * 100.0
    composite = _block(test(per_item, alpha), float(per_item @ base_scores), float(per_item @ new_scores), 1)
    result: dict[str, Any] = {
        "paired": len(pairing.pairs), "alpha": alpha, "weights": weights, "composite": composite,
        "only_in_base": pairing.only_in_base, "only_in_new": pairing.only_in_new,
        "changed_content": pairing.changed, "checked_by": pairing.checked_by,
    }
    for key, plural in (("group", "groups"), ("tier", "tiers")):
        members = sorted(set(labels[key]))
        family = {}
        for label in members:  # Bonferroni: each of the m members is tested, and its interval built, at alpha / m
            inside = labels[key] == label
            coefficients = np.where(inside, 100.0 / np.count_nonzero(inside), 0.0)
            family[label] = _block(test(coefficients, alpha / len(members)), float(base_scores[inside].mean() * 100),
                                   float(new_scores[inside].mean() * 100), len(members))
        result[plural] = family
    result["summary"] = summarize_comparison(result) + pairing.notes
    return result


def format_points(value: float) -> str:
    """A delta or interval end in points; never prints a nonzero end as 0.0, so the sign stays readable."""
    text = f"{value:+.1f}"
    if value != 0 and float(text) == 0:
        text = f"{value:+.2g}"
    return "0.0" if value == 0 else text


def verdict_kind(test: dict) -> str:
    """What one paired test says, as one of ``improvement``, ``regression``, ``no_change``, ``too_few_items``
    or ``not_significant`` — the one rule behind every wording (``summarize_comparison``, the report's tables)."""
    if test["significant"]:
        return "improvement" if test["delta"] > 0 else "regression"
    if test["n_changed"] == 0:
        return "no_change"
    return "too_few_items" if test["too_few_items"] else "not_significant"


def _describe(name: str, test: dict, alpha: float, family: str) -> str:
    m = test["family_size"]
    if m > 1:
        interval = f"{1 - alpha:.0%} simultaneous CI over {m} {family}"
        p = f"p={test['p_adjusted']:.4f} Bonferroni-adjusted"
    else:
        interval, p = f"{test['confidence']:.0%} CI", f"p={test['p_value']:.4f}"
    numbers = (f"{test['base']:.1f} -> {test['new']:.1f} ({format_points(test['delta'])} points, {interval} "
               f"[{format_points(test['ci_low'])}, {format_points(test['ci_high'])}], {p})")
    kind = verdict_kind(test)
    if kind in ("improvement", "regression"):
        verdict = f"a significant {kind} at the {alpha:g} level"
    elif kind == "no_change":
        verdict = "no change on any item"
    elif kind == "too_few_items":
        changed = f"{test['n_changed']} item{'s' if test['n_changed'] != 1 else ''} changed"
        level = f"{alpha:g} / {m} {family}" if m > 1 else f"{alpha:g}"
        verdict = (f"too few items to tell: {changed}; at the {level} level at least {test['items_needed']} "
                   "items must change before any outcome can be significant")
    else:
        verdict = "not significant: consistent with no change"
    warnings = "".join(f" Warning: {warning}." for warning in test["warnings"])
    return f"{name}: {numbers}: {verdict}.{warnings}"


def summarize_comparison(result: dict) -> list[str]:
    """Plain-language lines: the composite first, then every group and tier, then what they add up to."""
    alpha = result["alpha"]
    lines = [_describe("composite index", result["composite"], alpha, "")]
    lines += [_describe(f"group {g}", t, alpha, "groups") for g, t in result["groups"].items()]
    lines += [_describe(f"tier {k}", t, alpha, "tiers") for k, t in result["tiers"].items()]
    named = [("composite index", result["composite"])] + [(f"group {g}", t) for g, t in result["groups"].items()]
    named += [(f"tier {k}", t) for k, t in result["tiers"].items()]
    significant = [name for name, t in named if t["significant"] and not name.startswith("tier")]
    if significant:
        lines.append("Significant changes: " + ", ".join(significant) + ".")
    else:
        lines.append("No change is statistically significant; differences of this size can arise from item sampling alone.")
    too_few = [name for name, t in named if t["too_few_items"] and t["n_changed"]]
    if too_few:
        lines.append("Too few items to tell: " + ", ".join(too_few) + " (more items are needed before a verdict).")
    return lines
