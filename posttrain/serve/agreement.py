"""Agreement and bias statistics for the admin page: pure functions of labels, no database, no web.

Labels are any hashable values (the service uses ``a`` / ``b`` / ``tie`` / ``both_bad``, the outcome of a
vote in the pair's canonical order, so that the side it was shown on does not matter).

- ``cohen_kappa``: Cohen (1960), two raters on the same items. With ``p_o`` the observed agreement and
  ``p_e = Σ_k p_1(k) p_2(k)`` the agreement expected from each rater's own label frequencies,
  ``κ = (p_o − p_e) / (1 − p_e)``. Undefined (None) when ``p_e = 1`` (both raters always give one and
  the same label) or there are no items.
- ``krippendorff_alpha_nominal``: Krippendorff (2004; "Computing Krippendorff's alpha-reliability", 2011),
  any number of raters, missing values allowed, nominal metric. Units with fewer than two values are not
  pairable and are left out. From the coincidence matrix ``o_ck = Σ_u (pairs (c, k) in u) / (m_u − 1)``,
  ``n_c = Σ_k o_ck`` and ``n = Σ_c n_c``:
  ``α = 1 − D_o / D_e = 1 − (n − 1) · Σ_{c≠k} o_ck / Σ_{c≠k} n_c n_k``. Undefined (None) when every
  pairable value is the same label (``D_e = 0``) or nothing is pairable.
- ``binomial_two_sided``: the exact two-sided binomial test of ``k`` successes in ``n`` trials against
  success probability ``p``: the sum of the probabilities of every outcome no more likely than ``k``
  (the "minlike" rule, as scipy's ``binomtest``), with a relative tolerance of 1e-7 for ties.
- ``share_test``: a share with its binomial test against 1/2 (position bias: the share of decisive votes
  that went to the left-shown response; length bias: the share that went to the longer response).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from itertools import permutations


def cohen_kappa(first: Sequence[Hashable], second: Sequence[Hashable]) -> float | None:
    """Cohen's κ of two raters' labels on the same items (``first[i]`` and ``second[i]`` label item i)."""
    if len(first) != len(second):
        raise ValueError(f"the raters labelled different numbers of items ({len(first)} and {len(second)})")
    n = len(first)
    if n == 0:
        return None
    observed = sum(a == b for a, b in zip(first, second, strict=True)) / n
    counts_1, counts_2 = Counter(first), Counter(second)
    expected = sum(counts_1[label] * counts_2[label] for label in counts_1) / (n * n)
    if math.isclose(expected, 1.0):
        return None
    return (observed - expected) / (1.0 - expected)


def krippendorff_alpha_nominal(units: Sequence[Sequence[Hashable]]) -> float | None:
    """Krippendorff's α (nominal) of ``units``: each unit is the list of labels it got (missing ones omitted)."""
    coincidence: Counter = Counter()
    for values in units:
        m = len(values)
        if m < 2:
            continue  # not pairable
        for c, k in permutations(values, 2):  # ordered pairs of distinct positions
            coincidence[(c, k)] += 1.0 / (m - 1)
    totals: Counter = Counter()
    for (c, _), weight in coincidence.items():
        totals[c] += weight
    n = sum(totals.values())
    if n <= 1:
        return None
    disagreement_observed = sum(w for (c, k), w in coincidence.items() if c != k)
    disagreement_expected = sum(totals[c] * totals[k] for c in totals for k in totals if c != k)
    if disagreement_expected == 0:
        return None
    return 1.0 - (n - 1) * disagreement_observed / disagreement_expected


def _binomial_pmf(k: int, n: int, p: float) -> float:
    if p in (0.0, 1.0):
        return float(k == (0 if p == 0.0 else n))
    log = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
    return math.exp(log)


def binomial_two_sided(k: int, n: int, p: float = 0.5) -> float:
    """Exact two-sided p-value of ``k`` successes in ``n`` trials under success probability ``p``."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 1.0
    observed = _binomial_pmf(k, n, p)
    threshold = observed * (1 + 1e-7)
    total = sum(prob for i in range(n + 1) if (prob := _binomial_pmf(i, n, p)) <= threshold)
    return min(1.0, total)


def share_test(successes: int, trials: int) -> dict[str, float | int | None]:
    """``{"n", "k", "share", "p_value"}``: the share of ``successes`` and its two-sided test against 1/2."""
    return {"n": trials, "k": successes, "share": successes / trials if trials else None,
            "p_value": binomial_two_sided(successes, trials) if trials else None}
