"""The model judge: robust z-scores over the pool, its place in the pipeline, and scores that a test recomputes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from posttrain.curate.config import ModelJudgeConfig
from posttrain.curate.model_judge import ModelJudgeStage, robust_z
from posttrain.curate.pipeline import run_curate
from tests.curate.conftest import make_config, pair, read_jsonl, write_jsonl


def test_robust_z_matches_a_hand_computation():
    values = np.array([1.0, 2.0, 3.0, 4.0, 100.0])
    # median 3; absolute deviations 2, 1, 0, 1, 97 -> MAD 1; sigma = 1.4826
    expected = (values - 3.0) / 1.4826
    assert np.allclose(robust_z(values), expected)
    assert np.allclose(robust_z(np.array([5.0, 5.0, 5.0])), 0.0)


def test_robust_z_falls_back_when_most_values_are_equal():
    values = np.array([2.0, 2.0, 2.0, 2.0, 0.0])  # MAD 0; mean absolute deviation 0.4
    assert np.allclose(robust_z(values), (values - 2.0) / (1.2533 * 0.4))


def test_decide_drops_low_outliers_only_and_annotates_every_scored_record():
    stage = ModelJudgeStage(ModelJudgeConfig(enabled=True, model="unused", max_z=3.0, min_records=5))
    scores = [np.array([-1.0, -1.1, -0.9, -1.05]), np.array([-0.95, -9.0, 3.0, np.nan])]
    alive = np.array([True, True, True, True, True, True, True, True])
    decisions = stage.decide(scores, alive, [f"r{i}" for i in range(8)])
    assert set(decisions.drops) == {5}  # -9 is far below; +3 is an outlier above, which is kept
    assert decisions.drops[5].reason == "model_judge_outlier"
    assert 7 not in decisions.annotations  # an unscored (empty) response carries no score
    assert decisions.annotations[6]["model_judge_z"] > 3.0


def test_decide_keeps_everything_below_min_records_and_ignores_dead_rows():
    stage = ModelJudgeStage(ModelJudgeConfig(enabled=True, model="unused", min_records=5))
    values = [np.array([-1.0, -1.0, -50.0, -1.2])]
    assert not stage.decide(values, np.ones(4, dtype=bool), list("abcd")).drops
    stage = ModelJudgeStage(ModelJudgeConfig(enabled=True, model="unused", min_records=3))
    alive = np.array([True, True, False, True])  # the outlier was already dropped by an earlier stage
    assert not stage.decide(values, alive, list("abcd")).drops


def test_enabling_it_needs_a_model():
    with pytest.raises(ValueError, match="model_judge.model"):
        ModelJudgeConfig(enabled=True)


def test_the_stage_scores_with_the_model_and_drops_what_its_scores_say(tmp_path, tiny_model_dir):
    """On a tiny random model the scores mean little; what is checked is the wiring: every kept record
    carries the model's mean token log-prob, and the drops are exactly the ones a z-score recomputed
    here from those scores calls outliers."""
    records = [pair(f"Write the word cat {i} times.", "cat " * (1 + i % 4)) for i in range(40)]
    records += [pair(f"Name colour number {i}.", "zq xj " * 12) for i in range(3)]
    source = write_jsonl(tmp_path / "raw.jsonl", records)
    config = make_config(source, tmp_path / "out", "model_judge.enabled=true", f"model_judge.model={tiny_model_dir}",
                         "model_judge.max_z=2.0", "model_judge.min_records=10", "judge.enabled=false",
                         "intent.enabled=false", "near_dedup.enabled=false", "filters.enabled=false",
                         "exact_dedup.enabled=false")
    assert run_curate(config) == 0
    kept = read_jsonl(tmp_path / "out" / "kept.jsonl")
    dropped = [d for d in read_jsonl(tmp_path / "out" / "dropped.jsonl") if d["stage"] == "model_judge"]
    scores = [r["meta"]["curate"]["scores"]["model_judge"] for r in kept] + [d["scores"]["model_judge"] for d in dropped]
    assert len(scores) == len(records) and all(math.isfinite(s) and s < 0 for s in scores)
    median = np.median(scores)
    sigma = 1.4826 * np.median(np.abs(np.array(scores) - median))
    expected_drops = sum((s - median) / sigma < -2.0 for s in scores)
    assert len(dropped) == expected_drops
    funnel = {row["stage"]: row for row in json.loads((tmp_path / "out" / "funnel.json").read_text())["stages"]}
    assert funnel["model_judge"]["in"] - funnel["model_judge"]["kept"] == expected_drops
    assert expected_drops > 0  # the data is built so that the check is not vacuous
