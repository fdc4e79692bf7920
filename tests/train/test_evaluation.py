"""The sharded evaluation pass on one process: sums, eval mode, and no autograd graph for held-out forwards."""

from __future__ import annotations

import pytest
import torch

from posttrain.train.evaluation import sharded_sums


def test_held_out_sums_run_without_autograd_in_eval_mode_and_add_up(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    units = [torch.randn(3) for _ in range(7)]
    seen = []

    def measure(module: torch.nn.Module, chunk: list[torch.Tensor]) -> torch.Tensor:
        seen.append((torch.is_grad_enabled(), module.training, len(chunk)))
        out = module(torch.stack(chunk)).sum()
        return torch.stack([out, torch.tensor(float(len(chunk)))])

    total = sharded_sums(model, units, 3, measure)
    assert seen == [(False, False, 3), (False, False, 3), (False, False, 1)]  # chunks of 3, 3 and 1
    assert model.training and torch.is_grad_enabled()  # both back as they were
    assert not total.requires_grad and total.dtype == torch.float64
    model.eval()
    with torch.no_grad():
        expected = model(torch.stack(units)).sum().double()
    assert float(total[1]) == 7.0
    assert float(total[0]) == pytest.approx(float(expected), rel=1e-6)  # dropout off: the eval-mode forward
