"""The RL prompt sampler: seeded order, curriculum pacing, the online difficulty filter, and exact state."""

from __future__ import annotations

import json

import pytest

from posttrain.rl.prompts import PromptSampler
from posttrain.train.stream import Difficulty, epoch_order


def items(n: int, tiers=(1, 2, 3)) -> list[Difficulty]:
    return [Difficulty(tiers[i % len(tiers)], None) for i in range(n)]


def test_none_curriculum_covers_every_prompt_once_per_epoch():
    sampler = PromptSampler(items(12), "none", seed=3)
    first = sampler.draw(0, 5) + sampler.draw(1, 7)
    assert sorted(first) == list(range(12))
    second = sampler.draw(2, 12)
    assert sorted(second) == list(range(12)) and second != first  # a fresh permutation per epoch


def test_tiered_curriculum_draws_easy_prompts_first():
    prompts = items(9)
    sampler = PromptSampler(prompts, "tiered", seed=0)
    tiers = [prompts[i].tier for i in sampler.draw(0, 9)]
    assert tiers == sorted(tiers) == [1, 1, 1, 2, 2, 2, 3, 3, 3]


def test_competence_pacing_starts_in_the_easiest_share_and_opens_up():
    prompts = items(30)
    sampler = PromptSampler(prompts, "competence", seed=0, competence_start=0.2, competence_steps=10)
    early = {prompts[i].tier for i in sampler.draw(0, 6)}
    assert early == {1}  # c(0) = 0.2: the easiest 6 of 30 are all tier 1
    late = [prompts[i].tier for step in range(10, 14) for i in sampler.draw(step, 10)]
    assert set(late) == {1, 2, 3}


def test_solved_and_hopeless_prompts_are_skipped_once_they_have_enough_tries():
    sampler = PromptSampler(items(6), "none", seed=1, pass_rate_low=0.0, pass_rate_high=1.0, min_tries=2)
    assert not sampler.filtering  # (0, 1) keeps everything
    sampler = PromptSampler(items(6), "none", seed=1, pass_rate_low=0.1, pass_rate_high=0.9, min_tries=2)
    sampler.record({0: (2, 2), 1: (0, 2), 2: (1, 2), 3: (1, 1)})  # solved, hopeless, half, too few tries
    assert [sampler.eligible(i) for i in range(6)] == [False, False, True, True, True, True]
    order = epoch_order(items(6), "none", 1, 0, True).tolist()
    drawn = sampler.draw(0, 4)
    assert drawn == [i for i in order if i not in (0, 1)]
    last = order.index(drawn[-1])
    assert sampler.skipped == sum(i in (0, 1) for i in order[:last]) and sampler.forced == 0


def test_a_draw_with_nothing_eligible_takes_what_comes_and_counts_it():
    sampler = PromptSampler(items(3), "none", seed=0, pass_rate_low=0.1, pass_rate_high=0.9, min_tries=1)
    sampler.record({0: (1, 1), 1: (1, 1), 2: (0, 1)})
    drawn = sampler.draw(0, 2)
    assert len(drawn) == 2
    assert sampler.skipped == 3 and sampler.forced == 2  # one epoch of skips, then forced


@pytest.mark.parametrize("curriculum", ["none", "tiered", "competence"])
def test_state_round_trips_through_json_and_continues_exactly(curriculum):
    def make():
        return PromptSampler(items(10), curriculum, seed=5, competence_steps=4, pass_rate_low=0.1,
                             pass_rate_high=0.9, min_tries=1)

    straight = make()
    for step in range(3):
        straight.draw(step, 4)
        straight.record({step: (1, 1)})
    saved = json.loads(json.dumps(straight.state()))
    expected = [straight.draw(step, 4) for step in range(3, 6)]
    resumed = make()
    resumed.load_state(saved)
    assert [resumed.draw(step, 4) for step in range(3, 6)] == expected
    assert resumed.state() == straight.state()
