"""The ``flywheel`` recipe: one round of curate → SFT → rejection sampling → DPO (→ GRPO) → eval → report."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from posttrain.config.loader import StrictModel
from posttrain.config.registry import register_recipe


class StageRecipe(StrictModel):
    """A stage runs an ordinary posttrain recipe file with dotted overrides on top."""

    recipe: str = Field(description="The stage's recipe: a packaged recipe's name (sft_tiny) or a YAML file path.")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Dotted key → value, as on the CLI.")


class BaseModelSpec(StrictModel):
    """The demo's base model: a tiny Llama pretrained here on plain task text (no hub is reachable)."""

    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    vocab_size: int = 1024
    corpus_documents: int = 3000
    pretrain: StageRecipe


class DataSpec(StrictModel):
    raw_pool: int = Field(default=6000, ge=10, description="Raw instruction records, with planted noise.")
    preamble_share: float = Field(
        default=1.0, ge=0.0, le=1.0, description="Share of clean raw records whose prompt carries a preamble."
    )
    rl_prompts: int = Field(default=600, ge=1, description="Prompts with answer keys for rejection sampling.")


class EvalSpec(StrictModel):
    n_per_cell: int = Field(default=30, ge=1, description="Eval items per (capability group, tier) cell.")
    max_new_tokens: int = Field(default=32, ge=1)
    batch_size: int = Field(default=64, ge=1)
    n_boot: int = Field(default=1000, ge=100)
    n_perm: int = Field(default=5000, ge=100)


class RLStageSpec(StageRecipe):
    """The optional GRPO stage after DPO (``posttrain quickstart --rl``): the DPO model trained with the
    verifier reward on the round's RL prompts of ``groups``."""

    enabled: bool = Field(default=False, description="Run GRPO after DPO and evaluate it (quickstart --rl).")
    groups: list[str] = Field(default_factory=lambda: ["reasoning"],
                              description="Capability groups whose RL prompts GRPO trains on.")
    eval_prompts: int = Field(default=64, ge=0, description="Held-out RL prompts for the reward curve at "
                              "train.eval_every (0: none).")


class FlywheelRecipe(StrictModel):
    recipe: Literal["flywheel"] = "flywheel"
    run_dir: str = "runs/quickstart"
    seed: int = 0
    data: DataSpec = Field(default_factory=DataSpec)
    base: BaseModelSpec
    curate: StageRecipe
    sft: StageRecipe
    sample: StageRecipe
    dpo: StageRecipe
    grpo: RLStageSpec | None = Field(default=None, description="Optional GRPO stage after DPO (quickstart --rl).")
    eval: EvalSpec = Field(default_factory=EvalSpec)
    threads: int | None = Field(
        default=None, ge=1, description="torch threads; default: OMP_NUM_THREADS, else all cores (posttrain.threads)."
    )


register_recipe(
    "flywheel",
    FlywheelRecipe,
    "posttrain.flywheel.run:run_flywheel",
    "One flywheel round: curate → SFT (curriculum) → rejection sampling → DPO → eval → report.",
)
