"""The built-in sample dataset: deterministic, valid, multi-turn, tiered, with correct answers."""

from __future__ import annotations

import re

from posttrain.data.formats import record_to_raw, to_record
from posttrain.data.samples import sample_sft_records


def test_deterministic_per_seed_and_different_across_seeds():
    assert sample_sft_records(30, seed=4) == sample_sft_records(30, seed=4)
    assert sample_sft_records(30, seed=4) != sample_sft_records(30, seed=5)


def test_shape_of_the_sample():
    records = sample_sft_records(64)
    assert len(records) == 64 and len({r.id for r in records}) == 64
    assert {r.tier for r in records} == {1, 2, 3, None}
    assert sum(sum(m.role == "assistant" for m in r.messages) > 1 for r in records) >= 64 // 5
    assert all(to_record(record_to_raw(r), "auto") == r for r in records)


def test_arithmetic_answers_are_correct():
    checked = 0
    for record in sample_sft_records(90):
        for question, answer in zip(record.messages[1::2], record.messages[2::2], strict=True):
            match = re.fullmatch(r"What is (\d+) (plus|times) (\d+)\?", question.content)
            if match:
                a, op, b = int(match[1]), match[2], int(match[3])
                assert answer.content.endswith(f"The answer is {a + b if op == 'plus' else a * b}.")
                checked += 1
    assert checked >= 20
