"""Task families: registry rules, determinism, the hash split, and verifiers on right and wrong answers."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from collections import Counter

import pytest

import posttrain.tasks as tasks
from posttrain.tasks.problem import EVAL_FRACTION, draw_problems, register_family, split_of

SAMPLES_PER_FAMILY = 150


def _many(family, n=SAMPLES_PER_FAMILY, seed=0):
    rng = random.Random(seed)
    return [family.sample(rng) for _ in range(n)]


def test_every_group_and_tier_has_at_least_two_families():
    for group in tasks.GROUPS:
        for tier in tasks.TIERS:
            assert len(tasks.families_in(group, tier)) >= 2, (group, tier)


def test_registry_rejects_duplicate_names_and_unknown_groups():
    existing = tasks.families_in()[0]
    with pytest.raises(ValueError, match="already registered"):
        register_family(existing.name, existing.group, existing.tier, "x", existing.wrong_answer)(
            existing.sample
        )
    with pytest.raises(ValueError, match="unknown group"):
        register_family("new_family", "poetry", 1, "x", existing.wrong_answer)
    with pytest.raises(ValueError, match="tier"):
        register_family("new_family", "reasoning", 4, "x", existing.wrong_answer)


@pytest.mark.parametrize("family", tasks.families_in(), ids=lambda f: f.name)
def test_problems_match_their_family_and_are_short(family):
    for problem in _many(family, 60):
        assert (problem.family, problem.group, problem.tier) == (family.name, family.group, family.tier)
        assert problem.prompt.isascii() and problem.answer.isascii()
        assert len(problem.prompt.split()) <= 30, problem.prompt
        assert len(problem.answer) <= 40 and problem.answer.strip() == problem.answer, problem.answer
        assert problem.statement and "?" not in problem.statement
        assert json.loads(problem.key)[0] == family.name


@pytest.mark.parametrize("family", tasks.families_in(), ids=lambda f: f.name)
def test_reference_answers_pass_and_wrong_answers_fail(family, verify):
    rng = random.Random(1)
    for problem in _many(family):
        assert verify(problem.verifier, problem.answer, problem.answer, problem.options), problem
        wrong = family.wrong_answer(problem, rng)
        assert wrong != problem.answer
        assert not verify(problem.verifier, wrong, problem.answer, problem.options), (problem.prompt, wrong)


@pytest.mark.parametrize("family", tasks.families_in(), ids=lambda f: f.name)
def test_same_key_means_same_problem(family):
    # The key is the problem's identity: two draws with one key must ask the same thing.
    answers: dict[str, str] = {}
    for problem in _many(family, 400):
        assert answers.setdefault(problem.key, problem.answer) == problem.answer, problem.key


def test_split_holds_out_about_the_eval_fraction():
    keys = {p.key for family in tasks.families_in() for p in _many(family, 300, seed=7)}
    eval_share = sum(split_of(k) == "eval" for k in keys) / len(keys)
    assert len(keys) > 3000
    assert abs(eval_share - EVAL_FRACTION) < 0.03


def test_sampling_is_deterministic_per_seed_and_varies_across_seeds():
    first = tasks.sample_problems(200, seed=3)
    assert first == tasks.sample_problems(200, seed=3)
    assert [p.key for p in first] != [p.key for p in tasks.sample_problems(200, seed=4)]
    assert len({p.key for p in first}) == 200  # unique by default
    assert {p.group for p in first} == set(tasks.GROUPS) and {p.tier for p in first} == set(tasks.TIERS)


def test_streams_are_independent():
    a = {p.key for p in tasks.sample_problems(300, seed=0)}
    b = {p.key for p in tasks.sample_problems(300, seed=0, stream="other")}
    assert len(a & b) < 150


def test_weights_shape_the_mix():
    problems = tasks.sample_problems(
        600, seed=0, group_weights={"reasoning": 2.0, "transformation": 0.0}, tier_weights={3: 0.0}
    )
    counts = Counter((p.group, p.tier) for p in problems)
    assert set(counts) == {
        ("reasoning", 1),
        ("reasoning", 2),
        ("instruction_following", 1),
        ("instruction_following", 2),
    }
    assert counts[("reasoning", 1)] == counts[("reasoning", 2)] == 200
    assert counts[("instruction_following", 1)] == counts[("instruction_following", 2)] == 100


def test_unknown_group_or_tier_is_an_error():
    with pytest.raises(ValueError, match="unknown task group"):
        tasks.sample_problems(10, seed=0, groups=["poetry"])
    with pytest.raises(ValueError, match="unknown tier"):
        tasks.sample_problems(10, seed=0, tiers=[5])
    with pytest.raises(ValueError, match="unknown groups \\['reasonning'\\]"):
        tasks.sample_problems(10, seed=0, group_weights={"reasonning": 2.0})
    with pytest.raises(ValueError, match="tiers \\[4\\]"):
        tasks.sample_problems(10, seed=0, tier_weights={4: 2.0})


_DIGEST_SCRIPT = """
import hashlib, json
import posttrain.tasks as t
payload = {
    "sft": [e.model_dump() for e in t.sft_examples(60, 5)],
    "rl": [r.model_dump() for r in t.rl_prompts(60, 5)],
    "eval": t.eval_items(6, 5),
    "pool": t.raw_pool(120, 5),
    "corpus": t.pretrain_corpus(20, 5),
}
print(hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest())
"""


def test_outputs_are_identical_across_processes_and_hash_seeds():
    # Python's str hash is salted per process; nothing we generate may depend on it.
    digests = []
    for hash_seed in ("1", "987"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        digests.append(run.stdout.strip())
    assert len(digests[0]) == len(hashlib.sha256().hexdigest())
    assert digests[0] == digests[1]


def test_repeats_come_only_after_a_family_is_used_up():
    family = tasks.TASK_FAMILIES["upper"]  # one word each: about 220 train problems
    few = draw_problems(family, 150, "train", random.Random(0), unique=False)
    assert len({p.key for p in few}) == 150
    many = draw_problems(family, 600, "train", random.Random(0), unique=False)
    assert all(split_of(p.key) == "train" for p in many)
    assert len({p.key for p in many}) >= 200  # nearly the whole train split before it repeats
    with pytest.raises(tasks.TaskSpaceExhausted, match="upper"):
        draw_problems(family, 600, "train", random.Random(0), unique=True)
