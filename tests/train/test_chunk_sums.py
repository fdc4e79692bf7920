"""``chunk_sums``: a held-out measure's sums and count as one float64 vector on the terms' own device."""

from __future__ import annotations

import torch

from posttrain.train.evaluation import chunk_sums


def test_the_count_follows_the_terms_device_and_every_term_is_float64():
    # "meta" stands in for CUDA here: a host tensor stacked with meta ones fails as it does with CUDA ones
    chosen = torch.ones(3, device="meta")
    sums = chunk_sums(chosen.sum(), (chosen > 0).sum(), count=3)
    assert sums.device.type == "meta" and sums.dtype == torch.float64 and sums.shape == (3,)
    on_host = chunk_sums(torch.tensor([1.5, 2.0]).sum(), torch.tensor([True, False]).sum(), count=2)
    assert on_host.tolist() == [3.5, 1.0, 2.0]
