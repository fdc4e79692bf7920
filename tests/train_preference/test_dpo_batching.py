"""Pair batching: the prefix-shared row and the two-row layout give the log-probs of separate forwards."""

from __future__ import annotations

import pytest
import torch

from posttrain.data.records import PreferencePair
from posttrain.models.load import load_model
from posttrain.models.logprobs import IGNORE_INDEX
from posttrain.train.pairs import (
    IDENTICAL_AFTER_TRUNCATION,
    PairLogprobModel,
    collate_pairs,
    model_inputs,
    split_pairs,
    tokenize_pairs,
)
from posttrain.train.reward_model import RewardModel, load_reward_lm


def make_pairs(n: int = 5) -> list[PreferencePair]:
    return [
        PreferencePair(
            prompt=[{"role": "user", "content": "Item 7. Name two fruits. " * (i + 1)}],
            chosen=[{"role": "assistant", "content": "apple and plum. " * (1 + i % 2)}],
            rejected=[{"role": "assistant", "content": "rock and sand."}],
            rationale=f"reason {i}",
        )
        for i in range(n)
    ]


def separate_logps(lm, examples) -> torch.Tensor:
    """Each sequence alone through the plain HF forward: the definition the batched paths must match."""
    values = []
    for example in examples:
        logits = lm(torch.tensor([example.input_ids])).logits.float().log_softmax(-1)[0]
        values.append(sum(logits[t - 1, example.input_ids[t]] for t in range(1, len(example.labels))
                          if example.labels[t] != IGNORE_INDEX))
    return torch.stack(values)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_prefix_shared_and_two_row_layouts_match_separate_forwards(pref_model_dir, attn):
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(pref_model_dir)
    lm = load_model(pref_model_dir, attn_implementation=attn)
    # max_length 48 truncates the longer pairs: their prompt is cut to the same tokens for both responses.
    data = tokenize_pairs(make_pairs(), tokenizer, 48, "left")
    assert data.truncated >= 2 and len(data.pairs) == 5
    expected = separate_logps(lm, [p.chosen for p in data.pairs] + [p.rejected for p in data.pairs])
    root = PairLogprobModel(lm, chunk_size=7)  # several head chunks
    with torch.no_grad():
        for sharing in (True, False):
            got = root(**model_inputs(collate_pairs(data.pairs, tokenizer.pad_token_id, sharing)))
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)


def test_joint_truncation_keeps_responses_whole_and_one_prompt(pref_model_dir):
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(pref_model_dir)
    full = tokenize_pairs(make_pairs(), tokenizer, 10_000, "left").pairs
    cut = tokenize_pairs(make_pairs(), tokenizer, 48, "left").pairs
    for whole, short in zip(full, cut, strict=True):
        assert max(len(short.chosen.input_ids), len(short.rejected.input_ids)) <= 48
        # Responses are kept whole; the prompt is the same for both (all of it is shared).
        assert len(short.chosen_targets) == len(whole.chosen_targets)
        assert len(short.rejected_targets) == len(whole.rejected_targets)
        first = short.chosen_targets[0]
        assert short.shared == first and short.chosen.input_ids[:first] == short.rejected.input_ids[:first]
        if short.truncated:  # left truncation keeps the prompt's last tokens
            kept = short.chosen.input_ids[:first]
            assert whole.chosen.input_ids[whole.chosen_targets[0] - len(kept) : whole.chosen_targets[0]] == kept


def test_pairs_that_truncation_spoils_are_dropped_with_a_reason(pref_model_dir):
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(pref_model_dir)
    same_start = PreferencePair(
        prompt=[{"role": "user", "content": "Name two fruits."}],
        chosen=[{"role": "assistant", "content": "apple and plum and " * 8 + "peach."}],
        rejected=[{"role": "assistant", "content": "apple and plum and " * 8 + "rock."}],
    )
    data = tokenize_pairs([same_start, *make_pairs(2)], tokenizer, 24, "left")
    assert data.dropped == {IDENTICAL_AFTER_TRUNCATION: 1}
    assert data.dropped_ids == [(same_start.id, IDENTICAL_AFTER_TRUNCATION)]
    assert len(data.pairs) + sum(data.dropped.values()) == 3
    assert [p.rationale for p in data.pairs] == ["reason 0", "reason 1"]  # carried through unchanged


def test_reward_head_reads_the_same_last_token_in_both_layouts(pref_model_dir):
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(pref_model_dir)
    torch.manual_seed(0)
    lm = load_reward_lm(pref_model_dir, "float32", "sdpa", False, tokenizer.pad_token_id)
    root = RewardModel(lm).eval()
    data = tokenize_pairs(make_pairs(4), tokenizer, 64, "left")
    with torch.no_grad():
        shared = root(**{k: v for k, v in collate_pairs(data.pairs, tokenizer.pad_token_id, True).items()
                         if k in ("input_ids", "position_ids", "attention_mask", "last_index")})
        rows = root(**{k: v for k, v in collate_pairs(data.pairs, tokenizer.pad_token_id, False).items()
                       if k in ("input_ids", "position_ids", "attention_mask", "last_index")})
        # HF's own forward on one unpadded sequence scores its last token too.
        hf = torch.stack([lm(torch.tensor([p.chosen.input_ids])).logits[0, 0] for p in data.pairs])
    torch.testing.assert_close(shared, rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split_pairs(shared)[0], hf, rtol=1e-5, atol=1e-5)


def test_recomputed_gated_mlp_gives_the_same_loss_and_gradients(pref_model_dir):
    from posttrain.models.blocks import recompute_gated_mlp
    from posttrain.models.load import load_tokenizer

    tokenizer = load_tokenizer(pref_model_dir)
    data = tokenize_pairs(make_pairs(4), tokenizer, 64, "left")
    batch = model_inputs(collate_pairs(data.pairs, tokenizer.pad_token_id, True))
    results = []
    for lean in (False, True):
        lm = load_model(pref_model_dir)
        if lean:
            assert recompute_gated_mlp(lm) == 2
        root = PairLogprobModel(lm)
        values = root(**batch)
        values.sum().backward()
        results.append((values.detach(), {n: p.grad.clone() for n, p in root.named_parameters()}))
    (plain, plain_grads), (lean, lean_grads) = results
    torch.testing.assert_close(lean, plain, rtol=0, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=1e-6, atol=1e-7)
