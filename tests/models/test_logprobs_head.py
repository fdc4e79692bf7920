"""The chunked output head: kept logits and recomputed (checkpointed) logits give the same numbers."""

from __future__ import annotations

import torch

from posttrain.models.logprobs import chunked_token_logprobs


def _reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(hidden @ weight.T, dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _values_and_grads(keep_logits_bytes: int | None, chunk_size: int = 5):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=generator, requires_grad=True)
    weight = torch.randn(11, 8, generator=generator, requires_grad=True)
    targets = torch.randint(0, 11, (13,), generator=generator)
    if keep_logits_bytes is None:
        values = _reference(hidden, weight, targets)
    else:
        values = chunked_token_logprobs(hidden, weight, targets, chunk_size, keep_logits_bytes=keep_logits_bytes)
    (values * torch.linspace(-1.0, 2.0, 13)).sum().backward()
    return values.detach(), hidden.grad, weight.grad


def test_kept_and_recomputed_head_match_the_full_softmax():
    reference = _values_and_grads(None)
    recomputed = _values_and_grads(0)  # every chunk checkpointed
    kept = _values_and_grads(10**9)  # logits kept for backward
    for got in (recomputed, kept):
        for want, have in zip(reference, got, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6)
    # Recomputation replays the same float ops, so the two head paths agree bit for bit.
    for a, b in zip(recomputed, kept, strict=True):
        assert torch.equal(a, b)


def _saved_shapes(keep_logits_bytes: int) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd keeps for backward outside any checkpoint."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, generator=generator, requires_grad=True)
    weight = torch.randn(10, 4, generator=generator, requires_grad=True)
    targets = torch.randint(0, 10, (6,), generator=generator)
    shapes: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chunked_token_logprobs(hidden, weight, targets, 3, keep_logits_bytes=keep_logits_bytes)
    return shapes


def test_budget_decides_whether_logits_are_kept_or_recomputed():
    logits_bytes = 6 * 10 * 4  # all float32 logits of the call below
    assert (3, 10) in _saved_shapes(logits_bytes)  # fits: each [chunk, vocab] block is kept for backward
    assert (3, 10) not in _saved_shapes(logits_bytes - 1)  # over budget: checkpointed, recomputed in backward


def test_host_loss_positions_select_what_the_device_mask_selects():
    """``loss_positions`` (flat indices, found on the host) picks the hidden states, targets and rows a
    boolean mask over ``labels[:, 1:]`` selects, in the same order."""
    from posttrain.models.logprobs import IGNORE_INDEX, loss_positions

    labels = torch.tensor([[IGNORE_INDEX, 7, 8, IGNORE_INDEX, 9],
                           [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX],
                           [3, IGNORE_INDEX, 4, 5, 6]])
    hidden = torch.arange(3 * 5 * 2, dtype=torch.float32).reshape(3, 5, 2)
    positions = loss_positions(labels)
    # by hand: row 0 predicts 7, 8 from t=0, 1 and 9 from t=3; row 2 predicts 4, 5, 6 from t=1, 2, 3
    assert positions["gather_index"].tolist() == [0, 1, 3, 11, 12, 13]
    assert positions["targets"].tolist() == [7, 8, 9, 4, 5, 6]
    assert positions["sequence_index"].tolist() == [0, 0, 0, 2, 2, 2]
    keep = labels[:, 1:] != IGNORE_INDEX  # the device-side selection: hidden[:, t] predicts labels[:, t + 1]
    selected, targets = hidden[:, :-1][keep], labels[:, 1:][keep]
    rows = torch.arange(3).unsqueeze(1).expand_as(keep)[keep]
    assert torch.equal(hidden.reshape(-1, 2).index_select(0, positions["gather_index"]), selected)
    assert torch.equal(positions["targets"], targets) and torch.equal(positions["sequence_index"], rows)
