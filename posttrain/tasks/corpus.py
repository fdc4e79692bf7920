"""Plain text for pretraining the tiny base model of the embedded demo.

No hub is reachable, so the demo's base model is pretrained here on text that looks like the facts
behind the tasks — never like the chat: no chat template, no questions, no instructions. Each
document mixes

- statements of *train-split* problems (``7 + 5 = 12.``, ``The word cat reversed is tac.``), so an
  eval problem or its answer never appears (its canonical key is in the eval split);
- spellings of the vocabulary (``The word cat is spelled c a t.``) so the model can see the
  letters inside multi-letter tokens — general knowledge every transformation task needs;
- counting runs (``Counting from 12: 13 14 15 16.``) for the number tokens.
"""

from __future__ import annotations

import random

from posttrain.tasks.problem import sample_problems
from posttrain.tasks.words import WORDS

STATEMENTS_PER_DOCUMENT = 4


def pretrain_corpus(n: int, seed: int, statements_per_document: int = STATEMENTS_PER_DOCUMENT) -> list[str]:
    """``n`` plain-text documents of a few lines each; deterministic for a seed."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{seed}:pretrain_corpus")
    problems = (
        sample_problems(n * statements_per_document, seed, split="train", unique=False, stream="corpus")
        if n
        else []
    )
    documents = []
    for index in range(n):
        lines = [
            p.statement
            for p in problems[index * statements_per_document : (index + 1) * statements_per_document]
        ]
        lines.append(_spelling(rng.choice(WORDS)))
        lines.append(_word_list(rng) if rng.random() < 0.5 else _counting(rng))
        rng.shuffle(lines)
        documents.append("\n".join(lines))
    return documents


def _spelling(word: str) -> str:
    return f"The word {word} is spelled {' '.join(word)}."


def _word_list(rng: random.Random) -> str:
    return "Some words: " + " ".join(rng.sample(WORDS, 5)) + "."


def _counting(rng: random.Random) -> str:
    start = rng.randint(0, 95)
    return f"Counting from {start}: " + " ".join(str(i) for i in range(start + 1, start + 6)) + "."
