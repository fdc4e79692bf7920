"""Turn problems into the records other stages read: SFT examples, RL prompts and eval items.

Training records (SFT, RL) come only from the ``train`` split and eval items only from the ``eval``
split (see ``posttrain.tasks.problem.split_of``), so the two never share a problem. Verifier options
(e.g. ifeval constraints) travel in ``meta["verifier_options"]`` of training records, where
``posttrain.eval.items.EvalItem.from_rl_prompt`` looks for them, and in ``options`` of eval items.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from posttrain.data.records import RLPrompt, SFTExample, assistant, stable_id, user
from posttrain.eval.items import EvalItem, Suite, register_suite
from posttrain.tasks.problem import (
    GROUPS,
    TIERS,
    Problem,
    Split,
    TaskSpaceExhausted,
    allocate,
    draw_problems,
    families_in,
    sample_problems,
)

EVAL_ITEM_KEYS = ("id", "prompt", "verifier", "answer", "tests", "group", "tier", "options", "meta")
SUITE_NAME = "flywheel"
DEFAULT_ITEMS_PER_CELL = 40


def _meta(problem: Problem) -> dict[str, Any]:
    return {"group": problem.group, "family": problem.family, "task_key": problem.key}


def to_sft(problem: Problem) -> SFTExample:
    """A one-turn chat whose assistant reply is the reference answer; ``meta.group`` names the capability."""
    return SFTExample(
        messages=[user(problem.prompt), assistant(problem.answer)],
        tier=problem.tier,
        meta={
            **_meta(problem),
            "verifier": problem.verifier,
            "verifier_options": copy.deepcopy(problem.options),
        },
    )


def to_rl(problem: Problem) -> RLPrompt:
    """An RL prompt with its answer key and verifier; the verifier's options are in ``meta.verifier_options``."""
    return RLPrompt(
        prompt=[user(problem.prompt)],
        answer=problem.answer,
        verifier=problem.verifier,
        group=problem.group,
        tier=problem.tier,
        meta={**_meta(problem), "verifier_options": copy.deepcopy(problem.options)},
    )


def to_eval_item(problem: Problem) -> dict[str, Any]:
    """An eval item as a dict with the keys of ``posttrain.eval.items.EvalItem`` (``EVAL_ITEM_KEYS``)."""
    return {
        "id": stable_id(problem.key, f"{SUITE_NAME}-{problem.family}-"),
        "prompt": problem.prompt,
        "verifier": problem.verifier,
        "answer": problem.answer,
        "tests": None,
        "group": problem.group,
        "tier": problem.tier,
        "options": copy.deepcopy(problem.options),
        "meta": {"family": problem.family, "task_key": problem.key},
    }


def sft_examples(n: int, seed: int, unique: bool = False, **sampling: Any) -> list[SFTExample]:
    """``n`` SFT examples from the train split; ``sampling`` goes to ``sample_problems`` (groups, tiers, weights).

    Problems repeat only once a family's train split is used up (``unique=True`` forbids repeats).
    """
    return [to_sft(p) for p in sample_problems(n, seed, split="train", unique=unique, **sampling)]


def rl_prompts(n: int, seed: int, unique: bool = False, split: Split = "train", **sampling: Any) -> list[RLPrompt]:
    """``n`` RL prompts with answers from the train split (``split="eval"``: held-out prompts for a GRPO recipe's
    ``data.eval``, never trained on); ``unique`` and ``sampling`` as for ``sft_examples``."""
    return [to_rl(p) for p in sample_problems(n, seed, split=split, unique=unique, **sampling)]


def eval_problems(
    n_per_cell: int,
    seed: int,
    group_scale: dict[str, float] | None = None,
    tiers: tuple[int, ...] = TIERS,
    split: str = "eval",
) -> list[Problem]:
    """Distinct problems of ``split``: ``round(n_per_cell * group_scale[group])`` per (group, tier) cell.

    ``split="train"`` draws a *dev* suite — traffic the flywheel's models meet in use, whose failures
    feed the next round — which never shares a problem with the held-out eval split.

    A cell's items are split evenly between its families. Some families are small (a one-word task has a
    fifth of ~266 words in eval): one that holds fewer than its share gives all it has, and the rest goes to
    the cell's other families, then to the group's other tiers — so a group always holds its
    ``len(tiers) * round(n_per_cell * scale)`` items (a suite big enough to resolve a few points per group),
    as evenly spread as the problem space allows; only a group that cannot hold that many is an error.
    Each family draws from its own seeded stream, so the suite for a seed is the same on every machine,
    and a larger ``n_per_cell`` extends a smaller one.
    """
    if n_per_cell < 1:
        raise ValueError(f"n_per_cell must be >= 1, got {n_per_cell}")
    scale = {g: 1.0 for g in GROUPS} | (group_scale or {})
    unknown = sorted(set(scale) - set(GROUPS))
    if unknown:
        raise ValueError(f"unknown group(s) in group_scale: {unknown}; groups are {', '.join(GROUPS)}")
    problems: list[Problem] = []
    for group in GROUPS:
        cell_size = round(n_per_cell * scale[group])
        if cell_size > 0:
            problems.extend(_group_problems(group, cell_size * len(tiers), tiers, seed, split))
    return problems


def _group_problems(group: str, total: int, tiers: tuple[int, ...], seed: int, split: str) -> list[Problem]:
    """``total`` distinct problems of ``group``, evenly over ``tiers`` and each tier's families where they hold
    enough (``eval_problems``), tier by tier in family order."""
    families = {family.name: family for tier in tiers for family in families_in(group, tier)}
    by_tier = {tier: [f.name for f in families_in(group, tier)] for tier in tiers}
    drawn: dict[str, list[Problem]] = {}
    used_up: set[str] = set()  # families whose split held fewer than was asked of them

    def draw_family(name: str, count: int) -> list[Problem]:
        """A family's first ``count`` problems (fewer when its split holds fewer); a family's stream is seeded by
        its name, so a longer draw extends a shorter one."""
        if len(drawn.get(name, ())) < count and name not in used_up:
            rng = random.Random(f"{seed}:{split}:{name}")
            drawn[name] = draw_problems(families[name], count, split, rng, unique=True, at_most=True)
            if len(drawn[name]) < count:
                used_up.add(name)
        return drawn.get(name, [])[:count]

    def draw_tier(tier: int, count: int) -> list[Problem]:
        return [p for chosen in _fill_evenly(count, by_tier[tier], draw_family).values() for p in chosen]

    chosen = _fill_evenly(total, list(tiers), draw_tier)
    found = sum(len(items) for items in chosen.values())
    if found < total:
        raise TaskSpaceExhausted(
            f"group {group!r}: found only {found} of {total} distinct {split} problems in its families; ask for fewer"
        )
    return [problem for tier in tiers for problem in chosen[tier]]


def _fill_evenly(total: int, names: list[Any], draw: Any) -> dict[Any, list[Problem]]:
    """``total`` items split evenly over ``names`` by ``draw(name, count) -> items`` (which may give fewer when a
    name holds fewer): a name that comes up short keeps all it has and the others share what it lacks, until
    every name that got less than asked is used up or the total is met (water-filling)."""
    full: dict[Any, list[Problem]] = {}  # names that gave all they hold
    while True:
        open_names = [name for name in names if name not in full]
        if not open_names:
            return full
        remaining = total - sum(len(items) for items in full.values())
        shares = allocate(max(remaining, 0), {name: 1.0 for name in open_names})
        taken = {name: draw(name, shares[name]) for name in open_names}
        short = [name for name in open_names if len(taken[name]) < shares[name]]
        if not short:
            return {name: full[name] if name in full else taken[name] for name in names}
        full.update({name: taken[name] for name in short})


def eval_items(n_per_cell: int, seed: int, **options: Any) -> list[dict[str, Any]]:
    """Eval items as plain dicts (e.g. to write a JSONL suite file); ``options`` as for ``eval_problems``."""
    return [to_eval_item(p) for p in eval_problems(n_per_cell, seed, **options)]


def build_suite(
    n_per_cell: int = DEFAULT_ITEMS_PER_CELL,
    seed: int = 0,
    group_scale: dict[str, float] | None = None,
) -> list[EvalItem]:
    """The ``flywheel`` items: ``n_per_cell`` per (group, tier) cell, times ``group_scale[group]`` (default 1)."""
    return [EvalItem.model_validate(item) for item in eval_items(n_per_cell, seed, group_scale=group_scale)]


def flywheel_suite(
    n_per_cell: int = DEFAULT_ITEMS_PER_CELL,
    seed: int = 0,
    group_weights: dict[str, float] | None = None,
) -> Suite:
    """The built-in ``flywheel`` eval suite; ``group_weights`` weight the groups in the composite index."""
    return Suite(
        name=SUITE_NAME,
        items=build_suite(n_per_cell, seed),
        group_weights=group_weights or {group: 1.0 for group in GROUPS},
        description=(
            f"Built-in verifiable tasks (posttrain.tasks), eval split only: {n_per_cell} items per "
            f"(group, tier) cell, {len(GROUPS)} groups x {len(TIERS)} tiers, seed {seed}."
        ),
    )


register_suite(SUITE_NAME, flywheel_suite)
