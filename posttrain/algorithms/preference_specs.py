"""What each preference loss reads besides the policy log-probs — a table without torch.

The config layer (``posttrain.config.preference``) validates a ``dpo:`` section against this table, so
``posttrain validate`` and ``--help`` need not import torch. The loss functions themselves live in
``posttrain.algorithms.preference``; registering one there requires its row here, and a test checks
that the two agree.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.algorithms.registry import UnknownNameError


@dataclass(frozen=True)
class LossSpec:
    """What a loss reads besides the policy log-probs."""

    name: str
    needs_reference: bool = True
    needs_lengths: bool = False
    params: tuple[str, ...] = ("beta",)  # keyword parameters it reads (beyond the log-prob tensors and lengths)


LOSS_SPECS: dict[str, LossSpec] = {spec.name: spec for spec in (
    LossSpec("sigmoid"),
    LossSpec("cdpo", params=("beta", "label_smoothing")),
    LossSpec("robust", params=("beta", "label_smoothing")),
    LossSpec("hinge"),
    LossSpec("ipo", needs_lengths=True),
    LossSpec("apo_zero"),
    LossSpec("bco_pair", params=("beta", "bco_delta")),
    LossSpec("simpo", needs_reference=False, needs_lengths=True, params=("beta", "simpo_gamma")),
    LossSpec("orpo", needs_reference=False, needs_lengths=True, params=("orpo_lambda",)),
)}

# Passed to every loss by the trainer; a loss that does not read one ignores it.
COMMON_PARAMS = frozenset({"beta", "label_smoothing"})


def loss_spec(name: str) -> LossSpec:
    """The spec of loss ``name``; ``UnknownNameError`` naming the nearest loss otherwise."""
    try:
        return LOSS_SPECS[name]
    except KeyError:
        guess = difflib.get_close_matches(str(name), list(LOSS_SPECS), n=1, cutoff=0.5)
        hint = f"did you mean {guess[0]!r}?" if guess else f"valid names: {', '.join(sorted(LOSS_SPECS))}"
        raise UnknownNameError(f"unknown preference loss {name!r}; {hint}") from None


def check_loss_params(names: Sequence[str], params: dict) -> None:
    """Reject extra loss parameters that none of ``names`` reads (a typo would otherwise be ignored)."""
    used = set()
    for name in names:
        used.update(loss_spec(name).params)  # an unknown name fails here, with the nearest valid name
    for key in params:
        if key not in used and key not in COMMON_PARAMS:
            owners = sorted(n for n, spec in LOSS_SPECS.items() if key in spec.params)
            hint = f"it is read by {', '.join(owners)}" if owners else "no preference loss reads it"
            raise ValueError(f"loss parameter {key!r} is not used by {', '.join(names)}; {hint}")
