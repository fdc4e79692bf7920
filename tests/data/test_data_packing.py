"""Packing and padding on a real (tiny) model: the loss of a packed batch equals the loss of the same
examples padded, and neither changes any example's per-token log-probs."""

from __future__ import annotations

import pytest
import torch

from posttrain.data.packing import collate_packed, collate_padded, pack_examples
from posttrain.data.samples import sample_sft_records
from posttrain.data.tokenize import IGNORE_INDEX, TokenizedExample, tokenize_records
from posttrain.models.load import load_model
from posttrain.models.logprobs import model_token_logprobs

MAX_LENGTH = 256


@pytest.fixture(scope="module")
def examples(tiny_tokenizer) -> list[TokenizedExample]:
    tokenized, report = tokenize_records(sample_sft_records(12, seed=1), tiny_tokenizer, MAX_LENGTH, progress=False)
    assert report.truncated == 0
    return tokenized


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32", attn_implementation=request.param).eval()


def token_logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        values, _ = model_token_logprobs(
            model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), batch["position_ids"]
        )
    return values


def test_packed_loss_equals_padded_loss(model, examples, tiny_tokenizer):
    padded = token_logprobs(model, collate_padded(examples, tiny_tokenizer.pad_token_id))
    rows = pack_examples(examples, MAX_LENGTH, pad_token_id=tiny_tokenizer.pad_token_id)
    assert len(rows) < len(examples)  # several examples really share a row
    assert max(len(row.example_ids) for row in rows) >= 2
    packed = token_logprobs(model, collate_packed(rows))
    assert padded.numel() == packed.numel() == sum(e.num_targets - (e.labels[0] != IGNORE_INDEX) for e in examples)
    padded_loss, packed_loss = -padded.mean(), -packed.mean()
    assert abs(padded_loss.item() - packed_loss.item()) <= 1e-5


def test_padding_and_packing_leave_each_example_unchanged(model, examples, tiny_tokenizer):
    alone = torch.cat([token_logprobs(model, collate_padded([e], tiny_tokenizer.pad_token_id)) for e in examples])
    padded = token_logprobs(model, collate_padded(examples, tiny_tokenizer.pad_token_id, max_length=MAX_LENGTH))
    packed = token_logprobs(model, collate_packed(pack_examples(examples, MAX_LENGTH, tiny_tokenizer.pad_token_id)))
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def test_packing_needs_position_ids_without_attention_mask(model, examples, tiny_tokenizer):
    """Guard for the mechanism: with a full attention mask the examples would see each other."""
    batch = collate_packed(pack_examples(examples, MAX_LENGTH, tiny_tokenizer.pad_token_id))
    separate = token_logprobs(model, batch)
    leaking = token_logprobs(model, dict(batch, attention_mask=torch.ones_like(batch["input_ids"])))
    assert (separate - leaking).abs().max() > 1e-3


def test_collate_padded_layout():
    examples = [TokenizedExample([7, 8, 9], [-100, 8, 9], False, "a"), TokenizedExample([4], [4], False, "b")]
    batch = collate_padded(examples, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[7, 8, 9], [4, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 8, 9], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert collate_padded(examples, 0, max_length=5)["input_ids"].shape == (2, 5)
    with pytest.raises(ValueError, match="more than max_length=2"):
        collate_padded(examples, 0, max_length=2)


def test_pack_rejects_malformed_examples():
    with pytest.raises(ValueError, match="no tokens"):
        pack_examples([TokenizedExample([], [], False, "empty")], 8)
    with pytest.raises(ValueError, match="3 input ids but 2 labels"):
        pack_examples([TokenizedExample([1, 2, 3], [1, 2], False, "bad")], 8)


def test_packing_keeps_the_curriculum_order():
    examples = [TokenizedExample([i] * n, [i] * n, False, f"e{i}") for i, n in enumerate([3, 6, 1, 2, 5])]
    rows = pack_examples(examples, 8)
    # Greedy in order: a later short example never jumps into an earlier row with room for it.
    assert [row.example_ids for row in rows] == [["e0"], ["e1", "e2"], ["e3", "e4"]]
