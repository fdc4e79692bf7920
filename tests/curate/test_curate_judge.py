"""Judge parsing, the rule judge, the cache, and the LLM judge wired through the generation engine."""

from __future__ import annotations

import pytest

from posttrain.curate.config import JudgeConfig
from posttrain.curate.judge import UNPARSEABLE, JudgeCache, JudgeStage, RuleJudge, parse_judgement
from posttrain.curate.rows import Row


def row(prompt: str, response: str, index: int = 0) -> Row:
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return Row(index=index, source="t", line=index + 1, id=f"r{index}", messages=messages)


@pytest.mark.parametrize(
    "text,score",
    [
        ("Score: 4\nComplexity: 2\nIntent: coding\nReason: fine", 4),
        ("**Score:** 5/5", 5),
        ("I would give this a rating of 2.", 2),
        ("Overall 3 out of 5, decent.", 3),
        ("score=1", 1),
        ("4", 4),
        ("SCORE : (3)", 3),
    ],
)
def test_parse_judgement_finds_the_score(text, score):
    assert parse_judgement(text).score == score


@pytest.mark.parametrize("text", ["", "I like it", "Score: 9", "Score: ten", "12/50"])
def test_unparseable_replies_get_a_reason_not_a_crash(text):
    judgement = parse_judgement(text)
    assert judgement.score is None and judgement.reason.startswith(UNPARSEABLE)


def test_parse_reads_complexity_intent_and_reason():
    judgement = parse_judgement("Score: 4\nComplexity: 3\nIntent: Question Answering\nReason: clear   and right",
                                labels=["question_answering", "coding"])  # fmt: skip
    assert (judgement.complexity, judgement.intent, judgement.reason) == (3, "question_answering", "clear and right")
    assert parse_judgement("Score: 4\nIntent: poetry", labels=["coding"]).intent == "other"


def test_rule_judge_scores_and_explains():
    judge = RuleJudge(["coding", "question_answering", "reasoning", "writing", "extraction", "chit_chat"])
    good = judge.judge_one("What is 12 + 30?", "42")
    assert good.score >= 4 and good.reason
    assert judge.judge_one("What is 12 + 30?", "").score == 1
    assert judge.judge_one("How many legs does a cat have?", "I'm sorry, but I cannot help with that.").score <= 2
    truncated = judge.judge_one("Explain photosynthesis.", "Plants use light to turn water and carbon dioxide into "
                                "sugar and oxygen in a process that happens inside the chloroplasts of their")  # fmt: skip
    assert "truncated" in truncated.reason and truncated.score < good.score
    assert judge.judge_one("Write a python function to sort a list.", "def f(x): return sorted(x)").intent == "coding"
    assert judge.judge_one("Hi there! How are you?", "Great, thanks!").intent == "chit_chat"
    complex_task = "Write a story that must include a dragon, exactly three characters and end with a question."
    assert RuleJudge.complexity(complex_task) == 3 and RuleJudge.complexity("What is the capital of Peru?") == 1


def test_judge_stage_drops_low_scores_and_caches(tmp_path):
    cache = tmp_path / "judge.jsonl"
    stage = JudgeStage(JudgeConfig(min_score=3), cache_path=cache)
    rows = [row("What is 2 + 2?", "4", 0), row("What is 2 + 2?", "", 1)]
    verdicts = stage.apply(rows)
    assert verdicts[0] is None and verdicts[1].reason == "judge_low_score"
    assert rows[0].scores["judge"] >= 3 and rows[0].scores["judge_reason"]
    assert len(cache.read_text().splitlines()) == 2
    # A new stage reads the cache: the judge is not asked again for known records.
    calls = []
    again = JudgeStage(JudgeConfig(min_score=3), cache_path=cache)
    original = again.judge.judge
    again.judge.judge = lambda batch: calls.append(len(batch)) or original(batch)
    again.apply([row("What is 2 + 2?", "4", 0), row("New question?", "New answer.", 2)])
    assert calls == [1]
    assert len(JudgeCache(cache).entries) == 3


def test_llm_judge_with_a_tiny_model_never_crashes(tiny_model_dir, tmp_path):
    """A random tiny model writes gibberish: records become judge_unparseable, kept or dropped per config."""
    rows = [row("What is 2 + 2?", "4", 0), row("Name a fruit.", "apple", 1)]
    keep = JudgeStage(JudgeConfig(kind="llm", model=tiny_model_dir, backend="hf", max_new_tokens=8, cache=False))
    verdicts = keep.apply(rows)
    for record, verdict in zip(rows, verdicts, strict=True):
        if record.scores["judge"] is None:
            assert verdict is None and record.scores["judge_reason"].startswith(UNPARSEABLE)
    drop = JudgeStage(JudgeConfig(kind="llm", model=tiny_model_dir, backend="hf", max_new_tokens=8, cache=False,
                                  on_unparseable="drop"))  # fmt: skip
    for record, verdict in zip(rows, drop.apply([row("What is 2 + 2?", "4", 0), row("Name a fruit.", "apple", 1)]),
                               strict=True):  # fmt: skip
        assert (verdict is not None and verdict.reason == UNPARSEABLE) or record.scores.get("judge") is not None
    assert keep.judge.fingerprint.startswith("llm:")
