"""The paired sign-flip permutation test, and the confidence interval that is its inversion.

One test gives both numbers, so they cannot disagree: the interval excludes 0 exactly when the test
rejects "no change" at the same level.

**Statistic.** Two runs scored the same ``n`` items; ``d_i = new_i - base_i`` in [-1, 1]. A delta in
points is a weighted sum ``T = sum_i c_i d_i`` with ``c_i >= 0`` and ``sum_i c_i = 100`` (one group:
``c_i = 100 / n``; the composite index: ``c_i = 100 w_g / n_g`` for item i of group g).

**Test** (Fisher 1935, *The Design of Experiments* §21; Good 2005, *Permutation, Parametric and
Bootstrap Tests of Hypotheses* §3). Under H0 "no change", each ``d_i`` is as likely to have either
sign, so ``T*(s) = sum_i c_i s_i d_i`` over sign vectors ``s`` in {-1, +1}^n is the null distribution
and the two-sided p-value is the share of sign vectors with ``|T*(s)| >= |T|``. With ``n <=
EXACT_MAX_ITEMS`` every one of the ``2^n`` vectors is used (exact); otherwise ``B`` random ones and
``p = (1 + #extreme) / (1 + B)`` (Phipson & Smyth 2010, "Permutation p-values should never be zero").
Items with ``d_i = 0`` never change ``T*`` at ``delta = 0``, so with ``k`` changed items the smallest
p the exact test can give is ``2 / 2^k`` (both all-same-sign vectors are always as extreme):
``smallest_p(k)``. Below ``items_needed(level)`` changed items no outcome can be significant.

**Interval** (test inversion: Lehmann & Romano 2005, *Testing Statistical Hypotheses* §3.5; for
randomization tests, Garthwaite 1996, "Confidence intervals from randomization tests", Biometrics
52:1387). Under the shift model ``d_i = delta/100 + e_i`` (``e_i`` symmetric about 0), the same test
applied to ``d_i - delta/100`` gives ``p(delta)``, and the ``1 - a`` interval is ``{delta : p(delta) >
a}``. With the same sign vectors for every ``delta``, sign vector ``s`` is "as extreme" at ``delta``
iff ``|A_s - beta_s delta| >= |T - delta|`` (``A_s = T*(s)``, ``beta_s = sum_i c_i s_i / 100``),
i.e. iff ``delta`` lies between ``(T - A_s) / (1 - beta_s)`` and ``(T + A_s) / (1 + beta_s)``: an
interval that always contains ``T``. So ``p(delta)`` only falls as ``delta`` moves away from ``T``, and
the set is one interval whose ends are order statistics of those ends. It is clipped to [-100, 100],
the range a delta of scores in [0, 1] can take.

Honest departures: scores of right/wrong items are not a shift family, so the interval is exact only
under the shift model; for the mean it is asymptotically valid without it (the sign-flip variance of
the shifted mean is ``mean((d - delta)^2) / n``, which approaches the sampling variance), and slightly
wider than the normal-theory interval (``n - z^2`` in place of ``n``). When every ``d_i`` is the same
the interval has zero width: it then says the items agree, not that the population change is known.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

EXACT_MAX_ITEMS = 16  # 2^16 = 65,536 sign vectors: every one is enumerated up to here
_CHUNK = 2048  # sign vectors per matrix product, to bound memory on large suites
_TIE = 1e-9  # points: statistics this close to the observed one count as "as extreme" (float noise)
_RANGE = 100.0  # a delta of scores in [0, 1] lies in [-100, 100] points


def smallest_p(n_changed: int) -> float:
    """The smallest two-sided p-value of the exact sign-flip test with ``n_changed`` nonzero differences."""
    return 1.0 if n_changed == 0 else min(1.0, 2.0 / 2.0**n_changed)


def items_needed(level: float) -> int:
    """The fewest changed items with which the exact test can reach ``p <= level``: ``1 + log2(1/level)``."""
    count = 1
    while smallest_p(count) > level:
        count += 1
    return count


def sign_flips(n: int, n_perm: int, rng: np.random.Generator) -> tuple[np.ndarray, bool]:
    """``(signs, exact)``: every vector of {-1, +1}^n when ``n <= EXACT_MAX_ITEMS``, else ``n_perm`` random
    ones; int8 of shape ``(vectors, n)``."""
    if n <= EXACT_MAX_ITEMS:
        return np.array(list(itertools.product((1, -1), repeat=n)), dtype=np.int8).reshape(2**n, n), True
    return (rng.integers(0, 2, size=(n_perm, n), dtype=np.int8) * 2 - 1).astype(np.int8), False


@dataclass(frozen=True)
class SignFlipResult:
    """One paired test. ``rejected`` iff ``p_value <= level`` iff the ``1 - level`` interval excludes 0."""

    delta: float  # T, points
    p_value: float  # two-sided, at delta = 0
    level: float  # the test's alpha (alpha / m for a family of m tests)
    ci_low: float
    ci_high: float
    rejected: bool
    exact: bool  # every sign vector enumerated (else Monte Carlo)
    n: int  # items that count (c_i > 0)
    n_changed: int  # of those, items whose score changed
    warnings: list[str] = field(default_factory=list)

    @property
    def confidence(self) -> float:
        return 1.0 - self.level

    @property
    def too_few_items(self) -> bool:
        """No outcome of this many changed items could be significant at ``level``."""
        return not self.rejected and smallest_p(self.n_changed) > self.level


def _extreme_intervals(diffs: np.ndarray, coefficients: np.ndarray, signs: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(T, low, high)``: for each sign vector, the deltas at which it is as extreme as the data."""
    observed = float(coefficients @ diffs)
    weighted = coefficients * diffs
    lows, highs = [], []
    for start in range(0, signs.shape[0], _CHUNK):
        block = signs[start : start + _CHUNK].astype(np.float64)
        flipped = block @ weighted  # A_s
        beta = block @ coefficients / _RANGE
        # Vectors with one sign on every counted item are as extreme at every delta (|beta| = 1, A = +-T).
        uniform = np.abs(np.abs(block @ np.ones_like(coefficients)) - coefficients.size) < 0.5
        with np.errstate(divide="ignore", invalid="ignore"):
            first = (observed - flipped) / (1.0 - beta)
            second = (observed + flipped) / (1.0 + beta)
        low, high = np.minimum(first, second) - _TIE, np.maximum(first, second) + _TIE
        low[uniform], high[uniform] = -np.inf, np.inf
        lows.append(low)
        highs.append(high)
    return np.asarray(observed), np.concatenate(lows), np.concatenate(highs)


def sign_flip_test(diffs: np.ndarray, coefficients: np.ndarray, level: float, signs: np.ndarray,
                   exact: bool) -> SignFlipResult:  # fmt: skip
    """Test ``T = sum c_i d_i`` against 0 at ``level`` and invert the test into its ``1 - level`` interval.

    ``diffs``: paired differences in score units; ``coefficients``: points per unit of each difference
    (summing to 100 over the items that count; items with 0 are left out); ``signs`` from ``sign_flips``
    for the counted items. See the module docstring for the formulas.
    """
    counted = coefficients > 0
    diffs, coefficients = np.asarray(diffs, dtype=np.float64)[counted], np.asarray(coefficients)[counted]
    if signs.shape[1] != diffs.size:
        raise ValueError(f"{signs.shape[1]} signs per vector for {diffs.size} counted items")
    observed, low, high = _extreme_intervals(diffs, coefficients, signs)
    observed = float(observed)
    offset = 0 if exact else 1  # the Monte Carlo p counts the observed data as one of the vectors
    total = signs.shape[0] + offset

    def p_of(count: np.ndarray | int) -> np.ndarray | float:
        return (offset + count) / total

    p_value = float(p_of(int(np.count_nonzero((low <= 0.0) & (high >= 0.0)))))
    # The interval: deltas where at least `need` vectors are extreme, i.e. p(delta) > level. Every
    # vector's extreme interval contains T, so below T the count is #{low <= delta}, above it #{high >= delta}.
    counts = np.arange(signs.shape[0] + 1)
    need = int(np.argmax(p_of(counts) > level))  # p_of(N) = 1 > level, so one exists
    if need == 0:
        ci_low, ci_high = -_RANGE, _RANGE
    else:
        ci_low = float(np.sort(low)[need - 1])
        ci_high = float(np.sort(high)[::-1][need - 1])
    observed = 0.0 if abs(observed) < 4 * _TIE else observed  # float noise of a zero sum
    ci_low, ci_high = _snap(max(ci_low, -_RANGE), observed, -1), _snap(min(ci_high, _RANGE), observed, 1)
    n_changed = int(np.count_nonzero(diffs != 0))
    rejected = p_value <= level
    return SignFlipResult(
        delta=observed, p_value=p_value, level=level, ci_low=ci_low, ci_high=ci_high, rejected=rejected,
        exact=exact, n=int(diffs.size), n_changed=n_changed,
        warnings=_degenerate(diffs, coefficients, ci_low, ci_high),
    )


def _snap(end: float, observed: float, side: int) -> float:
    """Remove the tie tolerance (and float noise) from an interval end that sits on 0 or on the estimate.
    Only moves an end inwards (``side`` -1: a lower end, +1: an upper end) by at most ``2 * _TIE``; as
    the estimate is 0 or at least ``4 * _TIE`` from it, whether 0 is inside never changes."""
    for target in (0.0, observed):
        if 0.0 <= (end - target) * side <= 2 * _TIE:
            return target
    return end


def _degenerate(diffs: np.ndarray, coefficients: np.ndarray, ci_low: float, ci_high: float) -> list[str]:
    """Warnings for intervals that do not measure sampling uncertainty: one item, or no spread at all."""
    if diffs.size == 1:
        return ["one item only: no interval from one item is informative"]
    if np.ptp(diffs) == 0 and math.isclose(ci_low, ci_high, abs_tol=1e-6):
        change = f"{diffs[0] * 100:+.1f} points" if diffs[0] else "no change"
        return [f"every item shows the same difference ({change}), so the interval has zero width: it reflects "
                "that the items agree, not certainty about the change on other items"]
    return []
