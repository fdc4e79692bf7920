"""SFT examples, RL prompts and eval items, and the wall between training and evaluation."""

from __future__ import annotations

import re
from collections import Counter

import pytest

import posttrain.tasks as tasks
from posttrain.data.records import RLPrompt, SFTExample
from posttrain.eval.items import EvalItem, load_suite
from posttrain.eval.verifiers import verify as verify_result
from posttrain.tasks.problem import split_of

TRAIN_SAMPLE = 4000


@pytest.fixture(scope="module")
def suite_problems():
    return tasks.eval_problems(60, seed=0)


@pytest.fixture(scope="module")
def training_problems():
    return tasks.sample_problems(TRAIN_SAMPLE, seed=0, unique=False)


def test_sft_examples_carry_tier_group_and_the_reference_answer(verify):
    examples = tasks.sft_examples(90, seed=2)
    assert len(examples) == 90 and all(isinstance(e, SFTExample) for e in examples)
    for example in examples:
        user_turn, assistant_turn = example.messages
        assert (user_turn.role, assistant_turn.role) == ("user", "assistant")
        assert example.tier in tasks.TIERS and example.meta["group"] in tasks.GROUPS
        assert verify(
            example.meta["verifier"],
            assistant_turn.content,
            assistant_turn.content,
            example.meta["verifier_options"],
        )
        assert split_of(example.meta["task_key"]) == "train"
    assert Counter(e.tier for e in examples) == {1: 30, 2: 30, 3: 30}


def test_rl_prompts_carry_answer_verifier_group_and_options(verify):
    prompts = tasks.rl_prompts(90, seed=2)
    assert all(isinstance(p, RLPrompt) for p in prompts)
    for prompt in prompts:
        assert (
            prompt.answer
            and prompt.verifier in {"exact", "numeric", "ifeval"}
            and prompt.group in tasks.GROUPS
        )
        assert verify(prompt.verifier, prompt.answer, prompt.answer, prompt.meta["verifier_options"])
        assert split_of(prompt.meta["task_key"]) == "train"
    assert {p.group for p in prompts} == set(tasks.GROUPS)


def test_eval_items_follow_the_contract(verify):
    items = tasks.eval_items(8, seed=0)
    assert len(items) == 8 * len(tasks.GROUPS) * len(tasks.TIERS)
    for item in items:
        assert tuple(sorted(item)) == tuple(sorted(tasks.EVAL_ITEM_KEYS))
        assert isinstance(item["prompt"], str) and item["tests"] is None
        assert EvalItem.model_validate(item).model_dump() == item
        assert verify(item["verifier"], item["answer"], item["answer"], item["options"])
    assert len({item["id"] for item in items}) == len(items)
    assert Counter((i["group"], i["tier"]) for i in items) == {
        (g, t): 8 for g in tasks.GROUPS for t in tasks.TIERS
    }


def test_build_suite_scales_groups_and_is_deterministic():
    suite = tasks.build_suite(10, seed=1, group_scale={"reasoning": 2.0})
    assert all(isinstance(item, EvalItem) for item in suite)
    assert suite == tasks.build_suite(10, seed=1, group_scale={"reasoning": 2.0})
    per_group = Counter(item.group for item in suite)
    assert per_group == {"reasoning": 60, "instruction_following": 30, "transformation": 30}
    assert {i.prompt for i in tasks.build_suite(10, seed=2)} != {i.prompt for i in suite}
    with pytest.raises(ValueError, match="unknown group"):
        tasks.build_suite(10, seed=1, group_scale={"poetry": 1.0})


def test_flywheel_suite_is_registered_and_loads_through_the_eval_harness(verify):
    suite = load_suite("flywheel")  # validates every item's verifier options
    assert suite.name == "flywheel" and suite.groups == sorted(tasks.GROUPS)
    assert len(suite.items) == tasks.emit.DEFAULT_ITEMS_PER_CELL * len(tasks.GROUPS) * len(tasks.TIERS)
    assert set(suite.group_weights) == set(tasks.GROUPS)
    for item in suite.items:
        assert verify_result(item, item.answer).passed, item
    weighted = tasks.flywheel_suite(5, seed=0, group_weights={"reasoning": 2.0, "transformation": 1.0})
    assert weighted.group_weights == {"reasoning": 2.0, "transformation": 1.0}


def test_a_family_that_runs_out_gives_all_it_holds_and_its_group_stays_full():
    # One-word families have ~266 words, a fifth of them in eval: 360 items per cell is more than the one-word
    # cells hold. Each group still gets 3 x 360 distinct eval problems, the short families give all they have
    # (the same set for every seed), and the other families and tiers make up the rest as evenly as they can.
    small = tasks.eval_problems(40, seed=0)
    big = tasks.eval_problems(360, seed=0)
    other_seed = tasks.eval_problems(360, seed=1)
    for problems in (big, other_seed):
        assert len({p.key for p in problems}) == len(problems)
        assert all(split_of(p.key) == "eval" for p in problems)
        assert Counter(p.group for p in problems) == {group: 3 * 360 for group in tasks.GROUPS}
    by_family = {seed: Counter(p.family for p in problems) for seed, problems in ((0, big), (1, other_seed))}
    upper = {p.key for p in big if p.family == "upper"}
    assert by_family[0]["upper"] < 120 and upper == {p.key for p in other_seed if p.family == "upper"}
    tier_one = by_family[0]["upper"] + by_family[0]["lower"] + by_family[0]["repeat"]
    assert tier_one < 360 and by_family[0]["bullets"] > 120  # the other tiers made up the one-word cells' shortfall
    # Families with room draw from their own seeded stream: the small suite is the start of the big one.
    for family in ("bullets", "add", "sort_words"):
        first = [p.key for p in small if p.family == family]
        assert first == [p.key for p in big if p.family == family][: len(first)]
    assert {p.key for p in big} != {p.key for p in other_seed}


def test_asking_more_eval_items_than_a_group_holds_is_a_clear_error():
    # Tier 1 alone: the one-word families hold ~280 instruction-following eval problems between them.
    with pytest.raises(tasks.TaskSpaceExhausted, match="group 'instruction_following': found only 2.. of 300"):
        tasks.eval_problems(300, seed=0, tiers=(1,))


def test_eval_problems_are_all_in_the_eval_split_and_distinct(suite_problems):
    assert all(split_of(p.key) == "eval" for p in suite_problems)
    assert len({p.key for p in suite_problems}) == len(suite_problems)


def test_no_eval_problem_is_ever_trained_on(suite_problems, training_problems):
    eval_keys = {p.key for p in suite_problems}
    eval_prompts = {p.prompt for p in suite_problems}
    for seed in (0, 1):
        sft = tasks.sft_examples(1500, seed=seed, unique=False)
        rl = tasks.rl_prompts(1500, seed=seed, unique=False)
        assert not eval_prompts & {e.messages[0].content for e in sft}
        assert not eval_prompts & {r.prompt[0].content for r in rl}
        assert not eval_keys & ({e.meta["task_key"] for e in sft} | {r.meta["task_key"] for r in rl})
    assert not eval_keys & {p.key for p in training_problems}
    assert not eval_prompts & {p.prompt for p in training_problems}


def test_commuted_eval_problems_stay_out_of_training(suite_problems, training_problems):
    # "What is 7 + 5?" held out must also hold out "What is 5 + 7?".
    train_prompts = {p.prompt for p in training_problems}
    adds = [p for p in suite_problems if p.family == "add"]
    assert adds
    for problem in adds:
        a, b = re.findall(r"\d+", problem.prompt)
        assert f"What is {b} + {a}?" not in train_prompts


def test_eval_problems_are_absent_from_the_raw_pool(suite_problems):
    pool = tasks.raw_pool(1500, seed=0)
    eval_prompts = {p.prompt for p in suite_problems}
    eval_keys = {p.key for p in suite_problems}
    text = "\n".join(record["prompt"] for record in pool) + "\n"
    for prompt in eval_prompts:
        assert f" {prompt}\n" not in text
    assert not eval_prompts & {record["meta"]["task_prompt"] for record in pool}
    assert not {split_of(k) for k in eval_keys} - {"eval"}
