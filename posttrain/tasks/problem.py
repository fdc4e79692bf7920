"""What a task is, the registry of task families, and the hash split that keeps eval out of training.

A *task family* (``reverse_word``, ``add``, ``bullets``, …) belongs to one capability group and one
tier and knows how to draw a random ``Problem``, how to state its fact in plain text for
pretraining, and how to produce a plausible wrong answer (for the noisy pool, preference pairs and
the tests that show a verifier rejects it).

Train/eval disjointness is by construction: every problem has a canonical ``key`` (the family plus
its parameters, with order removed where order does not change the problem, e.g. ``3 + 4`` and
``4 + 3``). A hash of the key — not the seed — puts the problem in the ``eval`` or ``train``
split, so no seed, sample size or caller can ever produce an eval problem for training.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

GROUPS: tuple[str, ...] = ("reasoning", "instruction_following", "transformation")
# Groups chosen only by name: never in the default selection (groups=None) or the flywheel eval suite.
# tool_use: problems one Python call answers (posttrain.tasks.tool_use, the grpo_tools_tiny recipe's data).
OPT_IN_GROUPS: tuple[str, ...] = ("tool_use",)
ALL_GROUPS: tuple[str, ...] = GROUPS + OPT_IN_GROUPS
TIERS: tuple[int, ...] = (1, 2, 3)
TIER_NAMES: dict[int, str] = {1: "basic comprehension", 2: "logical application", 3: "complex creation"}
Split = Literal["train", "eval"]

# Share of every family's problem space held out for evaluation. Changing it reshuffles the split,
# so it is a constant, not a knob: eval scores stay comparable across runs and versions.
EVAL_FRACTION = 0.2
_SPLIT_SALT = "posttrain.tasks/split/v1"


@dataclass(frozen=True)
class Problem:
    """One checkable instruction: the prompt, its reference answer and how to verify an answer."""

    family: str
    group: str
    tier: int
    key: str  # canonical identity: decides the split and identifies duplicates
    prompt: str
    answer: str
    verifier: str  # a name in posttrain.eval.verifiers: exact, numeric, ifeval, ...
    options: dict[str, Any] = field(default_factory=dict)
    statement: str = ""  # the same fact as plain text, for the pretraining corpus


# One encoder for every key: ``json.dumps`` with non-default separators builds a new encoder per call, and
# drawing a suite calls this some 300,000 times (rejection sampling by split). Same text as json.dumps.
_KEY_JSON = json.JSONEncoder(separators=(",", ":"))


def canonical_key(family: str, *params: Any) -> str:
    return _KEY_JSON.encode([family, *params])


def split_of(key: str) -> Split:
    """``eval`` for a fixed ``EVAL_FRACTION`` of canonical keys, ``train`` for the rest."""
    digest = hashlib.sha256(f"{_SPLIT_SALT}:{key}".encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64
    return "eval" if bucket < EVAL_FRACTION else "train"


@dataclass(frozen=True)
class TaskFamily:
    name: str
    group: str
    tier: int
    sample: Callable[[random.Random], Problem]
    wrong_answer: Callable[[Problem, random.Random], str]  # a plausible answer that fails the verifier
    example: str  # one prompt -> answer line, for docs and --help


TASK_FAMILIES: dict[str, TaskFamily] = {}


def register_family(
    name: str,
    group: str,
    tier: int,
    example: str,
    wrong_answer: Callable[[Problem, random.Random], str],
) -> Callable[[Callable[[random.Random], Problem]], Callable[[random.Random], Problem]]:
    """Decorator: register ``sample(rng) -> Problem`` as the task family ``name``."""
    if group not in ALL_GROUPS:
        raise ValueError(f"task family {name!r}: unknown group {group!r}; groups are {', '.join(ALL_GROUPS)}")
    if tier not in TIERS:
        raise ValueError(f"task family {name!r}: tier must be 1, 2 or 3, got {tier!r}")

    def decorate(sample: Callable[[random.Random], Problem]) -> Callable[[random.Random], Problem]:
        if name in TASK_FAMILIES:
            raise ValueError(f"task family {name!r} is already registered")
        TASK_FAMILIES[name] = TaskFamily(name, group, tier, sample, wrong_answer, example)
        return sample

    return decorate


def families_in(group: str | None = None, tier: int | None = None) -> list[TaskFamily]:
    _load_families()
    return [
        family
        for family in TASK_FAMILIES.values()
        if (group is None or family.group == group) and (tier is None or family.tier == tier)
    ]


def _load_families() -> None:
    # The family modules register themselves on import; importing here keeps callers from having to.
    from posttrain.tasks import instruction, reasoning, tool_use, transformation  # noqa: F401


class TaskSpaceExhausted(ValueError):
    """More distinct problems were asked of a family than its split holds."""


# Without ``unique``, a draw still looks this many times for an unused problem before it accepts a
# repeat: training sets stay as varied as the family allows and only repeat once it is used up.
FRESH_TRIES = 20


def draw_problems(
    family: TaskFamily,
    count: int,
    split: Split,
    rng: random.Random,
    unique: bool,
    at_most: bool = False,
) -> list[Problem]:
    """``count`` problems of ``family`` from ``split``.

    Rejection sampling: a draw from the other split is thrown away and drawn again. With
    ``unique`` every key is distinct, and running out of problems is an error — or, with ``at_most``,
    the answer is every distinct problem found (fewer than ``count``). Without ``unique``,
    repeats come only once ``FRESH_TRIES`` draws in a row found nothing new.
    """
    used: set[str] = set()
    problems: list[Problem] = []
    attempts, budget = 0, 200 * count + 1000
    stale = 0  # draws in a row that found only used problems
    while len(problems) < count:
        attempts += 1
        if unique and attempts > budget:
            if at_most:
                return problems
            raise TaskSpaceExhausted(
                f"task family {family.name!r}: found only {len(problems)} of {count} distinct {split} problems "
                f"after {budget} draws; ask for fewer, or pass unique=False to allow repeats"
            )
        problem = family.sample(rng)
        if split_of(problem.key) != split:
            continue
        if problem.key in used:
            stale += 1
            if unique or stale < FRESH_TRIES:
                continue
        stale = 0
        used.add(problem.key)
        problems.append(problem)
    return problems


def sample_problems(
    n: int,
    seed: int,
    split: Split = "train",
    groups: tuple[str, ...] | list[str] | None = None,
    tiers: tuple[int, ...] | list[int] | None = None,
    group_weights: dict[str, float] | None = None,
    tier_weights: dict[int, float] | None = None,
    unique: bool = True,
    stream: str = "",
) -> list[Problem]:
    """``n`` problems from ``split``, spread over families by group and tier weights, in a seeded order.

    Every (group, tier) cell gets ``n`` times its normalised weight (group weight x tier weight,
    rounded so the counts add up to ``n``), split evenly between the cell's families. The result
    is shuffled, so a prefix is a fair sample. ``unique`` makes every problem distinct (an error
    when a family runs out); without it problems repeat only once a family is used up. ``stream`` names an independent random stream, so
    two consumers with the same seed (e.g. SFT data and the pretraining corpus) draw different problems.
    """
    _load_families()
    groups = tuple(groups or GROUPS)
    tiers = tuple(tiers or TIERS)
    for group in groups:
        if group not in ALL_GROUPS:
            raise ValueError(f"unknown task group {group!r}; groups are {', '.join(ALL_GROUPS)}")
    for tier in tiers:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; tiers are 1, 2, 3")
    unknown_groups = sorted(set(group_weights or {}) - set(ALL_GROUPS))
    unknown_tiers = sorted(set(tier_weights or {}) - set(TIERS))
    if unknown_groups or unknown_tiers:
        raise ValueError(
            f"weights name unknown groups {unknown_groups} or tiers {unknown_tiers}; "
            f"groups are {', '.join(ALL_GROUPS)}, tiers 1, 2, 3"
        )
    weights = {
        (g, t): (group_weights or {}).get(g, 1.0) * (tier_weights or {}).get(t, 1.0)
        for g in groups
        for t in tiers
    }
    per_cell = allocate(n, weights)
    problems: list[Problem] = []
    for (group, tier), cell_count in per_cell.items():
        cell_families = families_in(group, tier)
        shares = allocate(cell_count, {family.name: 1.0 for family in cell_families})
        for family in cell_families:
            family_rng = random.Random(f"{seed}:{stream}:{split}:{family.name}")
            problems.extend(draw_problems(family, shares[family.name], split, family_rng, unique))
    random.Random(f"{seed}:{stream}:{split}:order").shuffle(problems)
    return problems


def allocate(total: int, weights: dict[Any, float]) -> dict[Any, int]:
    """Split ``total`` in proportion to ``weights`` with the largest-remainder rule (counts sum to ``total``)."""
    if total < 0:
        raise ValueError(f"cannot allocate a negative count ({total})")
    positive = {k: w for k, w in weights.items() if w > 0}
    if any(w < 0 for w in weights.values()):
        raise ValueError(f"weights must be >= 0, got {weights}")
    if not positive:
        raise ValueError("every weight is zero: nothing to sample")
    scale = total / sum(positive.values())
    exact = {k: w * scale for k, w in positive.items()}
    counts = {k: int(v) for k, v in exact.items()}
    leftover = total - sum(counts.values())
    for k in sorted(exact, key=lambda k: (counts[k] - exact[k], str(k)))[:leftover]:
        counts[k] += 1
    return {k: counts.get(k, 0) for k in weights}
