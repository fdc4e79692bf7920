"""The pretraining corpus: plain text from the train split only, never an eval problem or the chat format."""

from __future__ import annotations

import pytest

import posttrain.tasks as tasks

CORPUS_SIZE = 1500


@pytest.fixture(scope="module")
def corpus():
    return tasks.pretrain_corpus(CORPUS_SIZE, seed=0)


def test_corpus_is_deterministic_and_sized(corpus):
    assert len(corpus) == CORPUS_SIZE
    assert tasks.pretrain_corpus(50, seed=0) == tasks.pretrain_corpus(50, seed=0)
    assert tasks.pretrain_corpus(50, seed=0) != tasks.pretrain_corpus(50, seed=1)
    assert tasks.pretrain_corpus(0, seed=0) == []


def test_corpus_is_plain_text_not_chat(corpus):
    text = "\n".join(corpus)
    assert "<|" not in text and "?" not in text
    for phrase in ("What is", "Reverse the word", "Write the word", "Sort these", "List "):
        assert phrase not in text, phrase
    assert "is spelled" in text and "Counting from" in text


def test_corpus_never_states_an_eval_problem(corpus):
    text = "\n" + "\n".join(corpus) + "\n"
    eval_problems = tasks.eval_problems(50, seed=0)
    assert len(eval_problems) > 300
    # Statements are whole lines of a document, so a leak would show up as a whole-line match.
    found = [p.statement for p in eval_problems if f"\n{p.statement}\n" in text]
    assert not found, found[:5]
    # The corpus does state training problems: the check above would see them if eval leaked.
    train_problems = tasks.sample_problems(300, seed=0, stream="corpus", unique=False)
    assert sum(f"\n{p.statement}\n" in text for p in train_problems) > 250


def test_every_family_contributes_statements(corpus):
    text = "\n".join(corpus)
    markers = {
        "add": " + ",
        "reverse_word": "reversed is",
        "json_pair": "JSON object",
        "word_problem": "gave away",
    }
    for family, marker in markers.items():
        assert marker in text, family
