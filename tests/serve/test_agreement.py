"""The admin page's statistics against hand-computed values, and the rate limiter's bucket arithmetic."""

from __future__ import annotations

import pytest

from posttrain.serve.agreement import binomial_two_sided, cohen_kappa, krippendorff_alpha_nominal, share_test
from posttrain.serve.ratelimit import TokenBuckets


def test_cohen_kappa_hand_computed():
    # 50 items: both yes 20, first yes/second no 5, first no/second yes 10, both no 15.
    # p_o = 35/50 = 0.7; first says yes 25/50, second 30/50 -> p_e = 0.5*0.6 + 0.5*0.4 = 0.5; kappa = 0.2/0.5 = 0.4
    first = ["y"] * 25 + ["n"] * 25
    second = ["y"] * 20 + ["n"] * 5 + ["y"] * 10 + ["n"] * 15
    assert cohen_kappa(first, second) == pytest.approx(0.4)
    assert cohen_kappa(["a", "b", "a"], ["a", "b", "a"]) == pytest.approx(1.0)
    # always opposite on a 50/50 split: p_o = 0, p_e = 0.5 -> kappa = -1
    assert cohen_kappa(["a", "b"], ["b", "a"]) == pytest.approx(-1.0)
    assert cohen_kappa(["a", "a"], ["a", "a"]) is None  # p_e = 1: undefined
    assert cohen_kappa([], []) is None
    with pytest.raises(ValueError):
        cohen_kappa(["a"], ["a", "b"])


def test_krippendorff_alpha_nominal_hand_computed():
    # units [a, a] and [a, b]: o_aa = 2, o_ab = o_ba = 1; n_a = 3, n_b = 1, n = 4
    # alpha = 1 - (n-1) * sum_{c!=k} o_ck / sum_{c!=k} n_c n_k = 1 - 3 * 2 / (3*1 + 1*3) = 0
    assert krippendorff_alpha_nominal([["a", "a"], ["a", "b"]]) == pytest.approx(0.0)
    # complete agreement with two categories present: alpha = 1
    assert krippendorff_alpha_nominal([["a", "a", "a"], ["b", "b"]]) == pytest.approx(1.0)
    # single-value units are not pairable and do not count
    assert krippendorff_alpha_nominal([["a", "a"], ["a", "b"], ["b"]]) == pytest.approx(0.0)
    assert krippendorff_alpha_nominal([["a", "a"], ["a"]]) is None  # one category only: D_e = 0
    assert krippendorff_alpha_nominal([["a"]]) is None


def test_krippendorff_alpha_matches_the_published_example():
    # Krippendorff (2011), "Computing Krippendorff's Alpha-Reliability", the 4 observers x 12 units example with
    # missing values: nominal alpha = 0.743 as printed there.
    missing = None
    observers = [
        [1, 2, 3, 3, 2, 1, 4, 1, 2, missing, missing, missing],
        [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, missing, 3],
        [missing, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, missing],
        [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, missing],
    ]
    units = [[value for value in unit if value is not None] for unit in zip(*observers, strict=True)]
    assert krippendorff_alpha_nominal(units) == pytest.approx(0.743, abs=5e-4)


def test_binomial_two_sided_hand_computed():
    assert binomial_two_sided(0, 5) == pytest.approx(2 / 32)  # P(0) + P(5)
    assert binomial_two_sided(1, 4) == pytest.approx((1 + 4 + 4 + 1) / 16)  # every outcome but the mode
    assert binomial_two_sided(8, 10) == pytest.approx(2 * (45 + 10 + 1) / 1024)
    assert binomial_two_sided(5, 10) == pytest.approx(1.0)
    # asymmetric p: n=3, p=0.2: P = .512, .384, .096, .008; k=2 -> P(2) + P(3) = 0.104
    assert binomial_two_sided(2, 3, 0.2) == pytest.approx(0.104)
    assert binomial_two_sided(0, 0) == 1.0
    assert share_test(3, 4) == {"n": 4, "k": 3, "share": 0.75, "p_value": pytest.approx(0.625)}
    assert share_test(0, 0)["share"] is None


def test_token_bucket_refills_at_the_rate():
    clock = [100.0]
    buckets = TokenBuckets(rate=2.0, burst=3, clock=lambda: clock[0])
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # empty: one token every 1/rate seconds
    assert buckets.take("b") == 0.0  # another key has its own bucket
    clock[0] += 0.5
    assert buckets.take("a") == 0.0
    assert buckets.take("a") > 0
    clock[0] += 100  # refills up to the burst, not beyond
    assert [buckets.take("a") for _ in range(4)][:3] == [0.0, 0.0, 0.0]
    assert TokenBuckets.retry_after_header(0.2) == "1" and TokenBuckets.retry_after_header(2.1) == "3"
    assert TokenBuckets(rate=0, burst=0).take("x") == 0.0  # off
