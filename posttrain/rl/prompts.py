"""Which prompts an RL step samples: a seeded stream with curriculum pacing and an online difficulty filter.

Order: ``data.curriculum`` as for SFT (``posttrain.train.stream``) — ``none``: each epoch a fresh
permutation; ``tiered``: each epoch easy to hard; ``competence``: each draw is uniform over the
easiest ``c(t)`` fraction of the prompts (Platanios et al. 2019), ``c`` rising to 1 at
``data.competence_steps``.

Online difficulty (``rl.pass_rate_low`` / ``rl.pass_rate_high``): every prompt's pass rate is tracked
from the verifier's verdicts on its samples; a prompt that has been tried at least
``pass_rate_min_tries`` times and whose pass rate is at or below ``low`` (too hard: no sample passes)
or at or above ``high`` (solved: every sample passes) is skipped — its group would carry no signal.
A draw skips at most one epoch's worth of prompts, then takes what comes (counted), so a run whose
prompts are all solved still trains instead of spinning.

The sampler's state (stream position, pass counts, counters) is plain JSON: it is saved in every
checkpoint and restored on resume and rollback, so a resumed run draws exactly the prompts it would
have drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from posttrain.train.stream import Difficulty, competence, difficulty_order, epoch_order


@dataclass
class PassRates:
    """Passes and tries per prompt index; only prompts that were sampled appear."""

    passes: dict[int, int] = field(default_factory=dict)
    tries: dict[int, int] = field(default_factory=dict)

    def add(self, index: int, passed: int, tried: int) -> None:
        self.passes[index] = self.passes.get(index, 0) + passed
        self.tries[index] = self.tries.get(index, 0) + tried

    def rate(self, index: int, min_tries: int) -> float | None:
        tried = self.tries.get(index, 0)
        return self.passes.get(index, 0) / tried if tried >= min_tries else None

    def state(self) -> dict[str, list[int]]:
        return {str(i): [self.passes.get(i, 0), n] for i, n in sorted(self.tries.items())}

    @classmethod
    def from_state(cls, state: dict[str, list[int]]) -> PassRates:
        rates = cls()
        for key, (passed, tried) in state.items():
            rates.passes[int(key)], rates.tries[int(key)] = passed, tried
        return rates


class PromptSampler:
    """Draws prompt indices for RL steps; see the module docstring."""

    def __init__(
        self,
        items: Sequence[Difficulty],
        curriculum: str,
        seed: int,
        *,
        shuffle: bool = True,
        competence_start: float = 0.25,
        competence_steps: int | None = None,
        pass_rate_low: float = 0.0,
        pass_rate_high: float = 1.0,
        min_tries: int = 4,
    ):
        if not items:
            raise ValueError("the prompt set is empty")
        self.items, self.curriculum, self.seed, self.shuffle = list(items), curriculum, seed, shuffle
        self.competence_start, self.competence_steps = competence_start, competence_steps
        self.low, self.high, self.min_tries = pass_rate_low, pass_rate_high, min_tries
        self.filtering = (pass_rate_low, pass_rate_high) != (0.0, 1.0)
        self.cursor = 0  # position in the concatenated epoch orders (none / tiered)
        self.draws = 0  # draws so far (competence: each draw has its own generator)
        self.rates = PassRates()
        self.skipped = 0  # prompts passed over by the difficulty filter
        self.forced = 0  # prompts taken although the filter would skip them (nothing else was eligible)
        self._easiest = difficulty_order(self.items) if curriculum == "competence" else None
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    def _at(self, position: int) -> int:
        n = len(self.items)
        epoch = position // n
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, epoch_order(self.items, self.curriculum, self.seed, epoch, self.shuffle))
        return int(self._epoch_cache[1][position % n])

    def eligible(self, index: int) -> bool:
        if not self.filtering:
            return True
        rate = self.rates.rate(index, self.min_tries)
        return rate is None or self.low < rate < self.high

    def _candidates(self, step: int, count: int):
        """An endless iterator of candidate indices for one draw."""
        if self.curriculum != "competence":
            while True:
                index = self._at(self.cursor)
                self.cursor += 1
                yield index
        n = len(self.items)
        pace = self.competence_steps or 1
        pool = max(1, math.ceil(competence(step, pace, self.competence_start) * n))
        rng = np.random.default_rng([self.seed, self.draws, 11])
        self.draws += 1
        while True:  # without replacement within a pool's permutation, then a new permutation
            for position in rng.permutation(pool):
                yield int(self._easiest[position])

    def draw(self, step: int, count: int) -> list[int]:
        """``count`` prompt indices for ``step``, honouring the curriculum and the difficulty filter."""
        chosen: list[int] = []
        budget = len(self.items)  # skips allowed in this draw before taking what comes
        if count <= 0:
            return chosen
        for index in self._candidates(step, count):  # stop right after the last pick: the cursor stays exact
            if self.eligible(index):
                chosen.append(index)
            elif budget > 0:
                budget -= 1
                self.skipped += 1
            else:
                self.forced += 1
                chosen.append(index)
            if len(chosen) == count:
                break
        return chosen

    def record(self, outcomes: dict[int, tuple[int, int]]) -> None:
        """Fold ``{prompt index: (passed samples, tried samples)}`` into the pass rates."""
        for index, (passed, tried) in outcomes.items():
            self.rates.add(index, passed, tried)

    def solved_share(self) -> float:
        """Share of the tried prompts whose pass rate is 1 (for the log)."""
        rated = [self.rates.rate(i, self.min_tries) for i in self.rates.tries]
        rated = [r for r in rated if r is not None]
        return sum(r >= 1.0 for r in rated) / len(rated) if rated else 0.0

    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "draws": self.draws, "rates": self.rates.state(), "skipped": self.skipped,
                "forced": self.forced}

    def load_state(self, state: dict[str, Any]) -> None:
        self.cursor, self.draws = int(state["cursor"]), int(state["draws"])
        self.rates = PassRates.from_state(state["rates"])
        self.skipped, self.forced = int(state["skipped"]), int(state["forced"])
