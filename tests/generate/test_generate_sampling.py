"""The token-choice math on hand-made logits with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.generate.sampling import (
    apply_temperature,
    filter_top_k,
    filter_top_p,
    greedy,
    row_seed,
    sample_inverse_cdf,
)


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = torch.isfinite(filter_top_k(logits, 2))
    assert kept.tolist() == [[False, True, False, True, False]]
    assert torch.equal(filter_top_k(logits, 0), logits)


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # mass before each token: 0, .5, .8, .95 -> p=0.75 keeps two tokens, p=0.85 three
    assert torch.isfinite(filter_top_p(logits, 0.75)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_top_p(logits, 0.85)).tolist() == [[True, True, True, False]]
    # the most likely token always survives
    assert torch.isfinite(filter_top_p(logits, 0.01)).tolist() == [[True, False, False, False]]


def test_top_p_works_on_unsorted_rows_independently():
    logits = torch.tensor([[0.0, 10.0, 0.0], [10.0, 0.0, 9.9]])
    kept = torch.isfinite(filter_top_p(logits, 0.9)).tolist()
    assert kept == [[False, True, False], [True, False, True]]


def test_temperature_scales_and_rejects_zero():
    assert torch.allclose(apply_temperature(torch.tensor([[2.0, 4.0]]), 2.0), torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError):
        apply_temperature(torch.tensor([[1.0]]), 0.0)


def test_greedy_breaks_ties_to_lowest_id():
    assert greedy(torch.tensor([[1.0, 3.0, 3.0]])).tolist() == [1]


def test_inverse_cdf_hits_the_expected_bins():
    logits = torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.25)]] * 4)
    uniforms = torch.tensor([0.0, 0.3, 0.74, 0.99])
    assert sample_inverse_cdf(logits, uniforms).tolist() == [0, 1, 1, 2]


def test_inverse_cdf_never_picks_filtered_tokens():
    logits = filter_top_k(torch.tensor([[0.0, 5.0, 0.0, 4.0]]), 2).repeat(200, 1)
    picks = sample_inverse_cdf(logits, torch.rand(200, dtype=torch.float64))
    assert set(picks.tolist()) <= {1, 3}


def test_inverse_cdf_matches_the_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3])
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    picks = sample_inverse_cdf(probs.log().repeat(20000, 1), uniforms)
    freq = torch.bincount(picks, minlength=3).double() / 20000
    assert torch.allclose(freq, probs.double(), atol=0.015)


def test_row_seed_is_stable_and_distinct():
    assert row_seed(0, 1, 2) == row_seed(0, 1, 2)
    seeds = {row_seed(s, p, k) for s in range(3) for p in range(5) for k in range(4)}
    assert len(seeds) == 60
