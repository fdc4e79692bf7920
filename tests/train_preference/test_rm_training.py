"""The Bradley–Terry reward model: learns held-out preferences, exports in HF format, scores through posttrain."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForSequenceClassification

from posttrain.data.io import read_records
from posttrain.models.load import load_tokenizer
from posttrain.train.pairs import tokenize_pairs
from posttrain.train.reward_model import holdout_split
from posttrain.train.reward_scorer import load_reward_scorer
from tests.train_preference.conftest import preference_rows, read_jsonl, rm_overrides, run_cli, write_jsonl


def test_reward_model_reaches_90_percent_held_out_and_scores_after_export(pref_model_dir, tmp_path):
    # Fruits are always preferred, whatever the prompt: a quality signal a scalar head can pick up.
    data = {"train": str(write_jsonl(tmp_path / "train.jsonl", preference_rows(192, seed=11, conditional=False))),
            "eval": str(write_jsonl(tmp_path / "eval.jsonl", preference_rows(64, seed=12, conditional=False)))}
    out = tmp_path / "rm"
    # The default health guard lets the learning phase of a tiny run through (no skipped update, below).
    extra = {"train.max_steps": 24, "train.lr": 1e-3}
    assert run_cli("rm", rm_overrides(pref_model_dir, data, out, **extra)) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["after"]["accuracy"] >= 0.9 and result["after"]["pairs"] == 64
    assert result["after"]["loss"] < result["before"]["loss"]
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert len(steps) == 24 and all({"accuracy", "rewards/margin", "rewards/chosen"} <= m.keys() for m in steps)
    assert not any(m["skipped"] for m in steps)

    # Exported in HF format: plain transformers loads it, with pad_token_id set for batched scoring.
    hf = AutoModelForSequenceClassification.from_pretrained(out / "final")
    assert hf.config.num_labels == 1 and hf.config.pad_token_id is not None
    score = load_reward_scorer(out / "final")
    held_out = read_records(data["eval"], kind="preference", progress=False)[0]
    items = [(r.prompt, r.chosen[0].content) for r in held_out] + [(r.prompt, r.rejected[0].content) for r in held_out]
    rewards = score(items)
    chosen, rejected = rewards[: len(held_out)], rewards[len(held_out):]
    assert sum(c > r for c, r in zip(chosen, rejected, strict=True)) / len(held_out) >= 0.9
    # The scorer reads the same number HF's own forward gives for a single unpadded sequence.
    tokenizer = load_tokenizer(str(out / "final"))
    pair = tokenize_pairs(held_out[:1], tokenizer, 64, "left").pairs[0]
    with torch.no_grad():
        direct = float(hf(torch.tensor([pair.chosen.input_ids])).logits[0, 0])
    assert abs(direct - chosen[0]) < 1e-4
    assert score([("Item 3. Name two things.", "apple and plum.")])[0] == score(
        [([{"role": "user", "content": "Item 3. Name two things."}], "apple and plum.")])[0]


def test_holdout_split_is_stable_and_disjoint(pref_model_dir, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(200, seed=13))
    records = read_records(str(path), kind="preference", progress=False)[0]
    pairs = tokenize_pairs(records, load_tokenizer(pref_model_dir), 64, "left").pairs
    kept, held = holdout_split(pairs, 0.1)
    again_kept, again_held = holdout_split(list(reversed(pairs)), 0.1)
    assert {p.id for p in held} == {p.id for p in again_held}
    assert not {p.id for p in kept} & {p.id for p in held}
    assert len(kept) + len(held) == 200 and 5 <= len(held) <= 40
