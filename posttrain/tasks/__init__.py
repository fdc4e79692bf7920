"""The built-in verifiable task suite: the embedded default's data, with checkable answers.

Three capability groups (``reasoning``, ``instruction_following``, ``transformation``) in three tiers
(1 basic comprehension, 2 logical application, 3 complex creation), plus the opt-in ``tool_use`` group
(``OPT_IN_GROUPS``: large-number arithmetic and counting for a Python tool, chosen only by name). Every
generator is seeded, every problem has a reference answer and a verifier, and a hash of each problem's
canonical form puts it in the train or the eval split, so eval items are never trained on.

- ``sft_examples(n, seed)`` / ``rl_prompts(n, seed)``: training records (train split).
- ``build_suite(n_per_cell, seed)``: the ``flywheel`` eval items (eval split); importing this
  package registers the suite as ``flywheel`` in ``posttrain.eval.items.SUITES``.
- ``raw_pool(n, seed)``: a raw instruction pool with planted noise for the curation funnel.
- ``pretrain_corpus(n, seed)``: plain text for pretraining the demo's tiny base model.
"""

from posttrain.tasks.corpus import pretrain_corpus
from posttrain.tasks.emit import (
    EVAL_ITEM_KEYS,
    SUITE_NAME,
    build_suite,
    eval_items,
    eval_problems,
    flywheel_suite,
    rl_prompts,
    sft_examples,
    to_eval_item,
    to_rl,
    to_sft,
)
from posttrain.tasks.pool import NOISE_KINDS, NoiseMix, raw_pool
from posttrain.tasks.problem import (
    EVAL_FRACTION,
    GROUPS,
    TASK_FAMILIES,
    TIER_NAMES,
    TIERS,
    Problem,
    TaskFamily,
    TaskSpaceExhausted,
    families_in,
    sample_problems,
    split_of,
)

__all__ = [
    "EVAL_FRACTION",
    "EVAL_ITEM_KEYS",
    "GROUPS",
    "NOISE_KINDS",
    "TASK_FAMILIES",
    "TIERS",
    "TIER_NAMES",
    "NoiseMix",
    "Problem",
    "TaskFamily",
    "TaskSpaceExhausted",
    "SUITE_NAME",
    "build_suite",
    "flywheel_suite",
    "eval_items",
    "eval_problems",
    "families_in",
    "pretrain_corpus",
    "raw_pool",
    "rl_prompts",
    "sample_problems",
    "sft_examples",
    "split_of",
    "to_eval_item",
    "to_rl",
    "to_sft",
]
