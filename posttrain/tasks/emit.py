"""Turn problems into the records other stages read: SFT examples, RL prompts and eval items.

Training records (SFT, RL) come only from the ``train`` split and eval items only from the ``eval``
split (see ``posttrain.tasks.problem.split_of``), so the two never share a problem.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from posttrain.data.records import RLPrompt, SFTExample, assistant, stable_id, user
from posttrain.tasks.problem import (
    GROUPS,
    TIERS,
    Problem,
    _allocate,
    draw_problems,
    families_in,
    sample_problems,
)

EVAL_ITEM_KEYS = ("id", "prompt", "verifier", "answer", "tests", "group", "tier", "options")


def _meta(problem: Problem) -> dict[str, Any]:
    return {"group": problem.group, "family": problem.family, "task_key": problem.key}


def to_sft(problem: Problem) -> SFTExample:
    """A one-turn chat whose assistant reply is the reference answer; ``meta.group`` names the capability."""
    return SFTExample(
        messages=[user(problem.prompt), assistant(problem.answer)],
        tier=problem.tier,
        meta={**_meta(problem), "verifier": problem.verifier, "options": copy.deepcopy(problem.options)},
    )


def to_rl(problem: Problem) -> RLPrompt:
    """An RL prompt with its answer key. ``meta.options`` holds the verifier options (e.g. ifeval constraints)."""
    return RLPrompt(
        prompt=[user(problem.prompt)],
        answer=problem.answer,
        verifier=problem.verifier,
        group=problem.group,
        tier=problem.tier,
        meta={**_meta(problem), "options": copy.deepcopy(problem.options)},
    )


def to_eval_item(problem: Problem) -> dict[str, Any]:
    """An eval item with exactly the keys of the eval harness contract (``EVAL_ITEM_KEYS``)."""
    return {
        "id": stable_id(problem.key, f"flywheel-{problem.family}-"),
        "prompt": problem.prompt,
        "verifier": problem.verifier,
        "answer": problem.answer,
        "tests": None,
        "group": problem.group,
        "tier": problem.tier,
        "options": copy.deepcopy(problem.options),
    }


def sft_examples(n: int, seed: int, **sampling: Any) -> list[SFTExample]:
    """``n`` SFT examples from the train split; ``sampling`` goes to ``sample_problems`` (groups, tiers, weights)."""
    return [to_sft(p) for p in sample_problems(n, seed, split="train", **sampling)]


def rl_prompts(n: int, seed: int, **sampling: Any) -> list[RLPrompt]:
    """``n`` RL prompts with answers from the train split; ``sampling`` as for ``sft_examples``."""
    return [to_rl(p) for p in sample_problems(n, seed, split="train", **sampling)]


def eval_problems(
    n_per_cell: int,
    seed: int,
    group_weights: dict[str, float] | None = None,
    tiers: tuple[int, ...] = TIERS,
) -> list[Problem]:
    """Distinct eval-split problems: ``round(n_per_cell * weight)`` per (group, tier) cell, evenly per family.

    Cells are filled in a fixed order and each family draws from its own seeded stream, so the
    suite for a seed is the same on every machine; a larger ``n_per_cell`` extends a smaller one.
    """
    if n_per_cell < 1:
        raise ValueError(f"n_per_cell must be >= 1, got {n_per_cell}")
    weights = {g: 1.0 for g in GROUPS} | (group_weights or {})
    unknown = sorted(set(weights) - set(GROUPS))
    if unknown:
        raise ValueError(f"unknown group(s) in group_weights: {unknown}; groups are {', '.join(GROUPS)}")
    problems: list[Problem] = []
    for group in GROUPS:
        cell_size = round(n_per_cell * weights[group])
        if cell_size <= 0:
            continue
        for tier in tiers:
            cell_families = families_in(group, tier)
            shares = _allocate(cell_size, {family.name: 1.0 for family in cell_families})
            for family in cell_families:
                rng = random.Random(f"{seed}:eval:{family.name}")
                problems.extend(draw_problems(family, shares[family.name], "eval", rng, unique=True))
    return problems


def eval_items(n_per_cell: int, seed: int, **options: Any) -> list[dict[str, Any]]:
    return [to_eval_item(p) for p in eval_problems(n_per_cell, seed, **options)]


def build_suite(
    n_per_cell: int = 40,
    seed: int = 0,
    group_weights: dict[str, float] | None = None,
) -> list[Any]:
    """The ``flywheel`` eval suite: ``n_per_cell`` items per (group, tier) cell times the group's weight.

    Returns ``posttrain.eval.items.EvalItem`` objects when the eval harness is installed, else
    plain dicts with the same keys.
    """
    items = eval_items(n_per_cell, seed, group_weights=group_weights)
    item_class = _eval_item_class()
    return [item_class(**item) for item in items] if item_class else items


def _eval_item_class() -> Any:
    try:
        from posttrain.eval.items import EvalItem
    except ImportError:  # the eval harness is optional for generating data
        return None
    return EvalItem
