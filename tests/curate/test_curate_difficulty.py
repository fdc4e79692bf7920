"""Difficulty signals, tiers and the IFD score under a reference model."""

from __future__ import annotations

import pytest
import torch

from posttrain.curate.config import DifficultyConfig, IFDConfig
from posttrain.curate.difficulty import (
    DifficultyStage,
    combine_signals,
    constraint_count,
    feature_difficulty,
    ifd_scores,
    reasoning_steps,
    tier_of,
)
from posttrain.curate.rows import Row


def row(prompt: str, response: str, **scores) -> Row:
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return Row(index=0, source="t", line=1, id="r", messages=messages, scores=dict(scores))


def test_features_grow_with_steps_constraints_and_length():
    easy = feature_difficulty("What is 2 + 2?", "4", 300)
    steps = "1. First add.\n2. Then carry.\n3. Therefore the sum is 42 because 40 + 2."
    harder = feature_difficulty("Add them; you must show exactly three steps in JSON format.", steps, 300)
    assert 0 <= easy < harder <= 1
    assert reasoning_steps(steps) >= 5 and constraint_count("You must use exactly 3 bullets, in JSON format.") == 4


def test_tiers_and_signal_mixing():
    assert [tier_of(d, (0.34, 0.6)) for d in (0.0, 0.33, 0.34, 0.59, 0.6, 1.0)] == [1, 1, 2, 2, 3, 3]
    assert combine_signals({"judge": 1.0, "features": 0.0}, {"judge": 3.0, "features": 1.0}) == 0.75
    assert combine_signals({"features": 0.2}, {"judge": 1.0, "ifd": 1.0, "features": 0.0}) is None


def test_stage_uses_judge_complexity():
    # Thresholds between the judge's three levels (0, 0.5, 1); the defaults are calibrated for mixed signals.
    stage = DifficultyStage(DifficultyConfig(weights={"judge": 1.0, "features": 0.0}, tier_thresholds=(0.34, 0.6)))
    rows = [row("a", "b", judge_complexity=1), row("a", "b", judge_complexity=2), row("a", "b", judge_complexity=3)]
    stage.apply(rows)
    assert [r.tier for r in rows] == [1, 2, 3] and [r.difficulty for r in rows] == [0.0, 0.5, 1.0]
    lone = [row("a", "b")]  # no judge rating: falls back to the features
    DifficultyStage(DifficultyConfig(weights={"judge": 1.0, "features": 0.0})).apply(lone)
    assert lone[0].tier == 1
    given = [row("a", "b", judge_complexity=3), row("a", "b", judge_complexity=3)]
    given[0].tier = given[1].tier = 1
    DifficultyStage(DifficultyConfig(weights={"judge": 1.0})).apply(given[:1])
    DifficultyStage(DifficultyConfig(weights={"judge": 1.0}, keep_given_tier=False)).apply(given[1:])
    assert [r.tier for r in given] == [1, 3] and given[0].difficulty == 1.0


def _mean_answer_loss(model, context: list[int], answer: list[int]) -> float:
    ids = torch.tensor([context + answer])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0, :-1]
    targets = ids[0, 1:]
    picked = logprobs.gather(-1, targets[:, None])[:, 0][len(context) - 1 :]
    return float(-picked.mean())


def test_ifd_matches_a_direct_computation(tiny_model_dir):
    from posttrain.models.load import load_model, load_tokenizer

    config = IFDConfig(model=tiny_model_dir, batch_size=2)
    prompts = [[{"role": "user", "content": "What is 12 plus 30?"}], [{"role": "user", "content": "Reverse hello"}]]
    responses = ["The answer is 42.", "olleh"]
    scores = ifd_scores(prompts, responses, config)
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    for messages, response, score in zip(prompts, responses, scores, strict=True):
        context = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"]  # fmt: skip
        answer = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        expected = _mean_answer_loss(model, context, answer) / _mean_answer_loss(model, [tokenizer.bos_token_id], answer)
        assert score == pytest.approx(expected, rel=1e-4)


def test_ifd_signal_and_drop(tiny_model_dir):
    config = DifficultyConfig(weights={"ifd": 1.0}, ifd=IFDConfig(model=tiny_model_dir, drop_above=0.5))
    rows = [row("What is 12 plus 30?", "The answer is 42."), row("Sort 3, 1, 2", "1, 2, 3")]
    verdicts = DifficultyStage(config).apply(rows)
    for record, verdict in zip(rows, verdicts, strict=True):
        assert record.scores["ifd"] > 0 and record.difficulty == pytest.approx(min(record.scores["ifd"], 1.0), abs=1e-4)
        assert (verdict is not None) == (record.scores["ifd"] > 0.5)
