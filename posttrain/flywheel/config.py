"""The ``flywheel`` recipe: rounds of curate → SFT → rejection sampling → DPO (→ GRPO) → eval → report.

Round 1 runs on the data of ``data`` (the built-in pool, or the user's files) from ``base``. With
``rounds: N`` > 1, each later round starts from the previous round's final model, captures that
model's failures on a dev suite through the feedback service, answers them by sampling, has a
scripted annotator judge them with reasons, exports them with lineage and merges them into the
round's own curated SFT and preference sets (``feedback``, ``next_round``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from posttrain.config.loader import StrictModel
from posttrain.config.registry import register_recipe
from posttrain.flywheel.overrides import check_overrides, flatten_overrides


class StageRecipe(StrictModel):
    """A stage runs an ordinary posttrain recipe file with overrides merged over it key by key."""

    recipe: str = Field(description="The stage's recipe: a packaged recipe's name (sft_tiny) or a YAML file path.")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Keys of the stage's recipe → values, dotted (train.lr: 1e-3) or nested "
        "(train: {lr: 1e-3}) alike, each merged over the recipe's value; `posttrain validate --config FILE --stage "
        "NAME` prints what the stage runs with."
    )

    _flat = field_validator("overrides", mode="before")(flatten_overrides)


def _checked_stage(stage: StageRecipe | None, info: ValidationInfo) -> StageRecipe | None:
    """A stage whose override keys all exist in its recipe (the recipe kind is the stage's name)."""
    if stage is not None:
        check_overrides(info.field_name, stage.overrides)
    return stage


class BaseModelSpec(StrictModel):
    """The base model: ``model`` (the user's HF model directory), or by default a tiny Llama pretrained
    here on plain task text (no hub is reachable)."""

    model: str | None = Field(default=None, description="Base model directory (HF format); skips pretraining.")
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    vocab_size: int = 1024
    corpus_documents: int = 3000
    pretrain: StageRecipe | None = None
    packaged: bool = Field(
        default=True, description="Use the base shipped with posttrain when it was pretrained from exactly this "
        "run's inputs (architecture, seed, pretraining config, corpus and pool; posttrain.flywheel.packaged_base); "
        "false: always pretrain here."
    )

    _stage = field_validator("pretrain")(_checked_stage)

    @model_validator(mode="after")
    def _check(self) -> BaseModelSpec:
        if self.model is None and self.pretrain is None:
            raise ValueError("base needs either model (a model directory) or pretrain (a recipe to pretrain one)")
        return self


class DataSpec(StrictModel):
    raw_pool: int | str = Field(
        default=6000, description="Raw instruction records: a count for the built-in pool with planted noise, "
        "or the user's file (any format `posttrain curate` reads)."
    )
    preamble_share: float = Field(
        default=1.0, ge=0.0, le=1.0, description="Share of clean raw records whose prompt carries a preamble."
    )
    rl_prompts: int | str = Field(
        default=600, description="Prompts with answer keys for rejection sampling: a count (built-in) or a file."
    )
    unkeyed_share: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Built-in pool: share of records whose answer key is withheld."
    )
    off_topic_share: float = Field(
        default=0.0, ge=0.0, le=0.5, description="Built-in pool: share planted with fluent answers to another task."
    )

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        for name in ("raw_pool", "rl_prompts"):
            value = getattr(self, name)
            if isinstance(value, int) and value < 1:
                raise ValueError(f"data.{name} must be a positive count or a file path, got {value}")
        return self


class EvalSpec(StrictModel):
    suite: str | None = Field(default=None, description="The user's eval suite file (JSONL of eval items); "
                              "default: the built-in flywheel suite.")
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


class FeedbackLoopSpec(StrictModel):
    """How a round's failures reach the next round: a dev suite (train-split problems the model meets in
    use, never the held-out eval suite), its failures posted to the feedback service, ``samples``
    alternatives per failure, and a scripted annotator (the verifier, writing its reason) voting on each
    (failure, alternative) pair."""

    dev_per_cell: int = Field(default=20, ge=1, description="Dev items per (group, tier) cell (built-in tasks).")
    dev_suite: str | None = Field(default=None, description="The user's dev suite file instead (eval items).")
    groups: list[str] | None = Field(default=None, description="Capture failures of these groups only (all: null).")
    samples: int = Field(default=6, ge=1, description="Alternatives sampled per captured failure.")
    temperature: float = Field(default=1.0, ge=0.0)
    max_new_tokens: int = Field(default=24, ge=1)
    batch_size: int = Field(default=64, ge=1)
    guideline: str = Field(default="Pick the answer that does exactly what the prompt asks; say why, naming "
                           "what each answer gives.", description="Annotation guideline shown with each pair.")
    guideline_version: str = "flywheel-v1"
    reference_answers: bool = Field(
        default=False, description="When none of a failure's sampled alternatives passes, the annotator writes the "
        "right answer: the dev item's reference answer is added as one more response (model_id "
        "`annotator-reference`), so the failure still yields a pair — the write-in a person would give.")


class NextRoundSpec(StrictModel):
    """What changes from round 2 on: a fresh raw pool and RL prompts, the curation overrides (the model
    judge, intent labels) and the training overrides for continuing from the previous round's model."""

    raw_pool: int | str = Field(default=3000, description="Round k's raw records: a count (built-in, seed + k) or a file.")
    rl_prompts: int | str = Field(default=1500, description="Round k's RL prompts: a count or a file.")
    unkeyed_share: float = Field(default=0.4, ge=0.0, le=1.0)
    off_topic_share: float = Field(default=0.06, ge=0.0, le=0.5)
    curate: dict[str, Any] = Field(default_factory=dict, description="Overrides merged over the curate stage's.")
    sft: dict[str, Any] = Field(default_factory=dict, description="Overrides merged over the SFT stage's.")
    sample: dict[str, Any] = Field(default_factory=dict, description="Overrides merged over the sample stage's.")
    dpo: dict[str, Any] = Field(default_factory=dict, description="Overrides merged over the DPO stage's.")
    model_judge: bool = Field(default=True, description="Curate with the previous round's policy as a judge.")
    sft_from_samples: bool = Field(
        default=False, description="Round k's SFT set also takes its sample stage's best-of-n answers — the previous "
        "round's final model's own, kept only when verified (the sample stage's min_score must be set): "
        "rejection-sampling fine-tuning, so what the previous round's RL taught is trained on, not trained away.")
    replay: bool = Field(
        default=False, description="Round k's SFT set also takes the previous round's curated SFT records (replay): "
        "the fresh pool adds to what the previous model was trained on instead of replacing it, so round k's SFT "
        "trains less of it away.")

    _flat = field_validator("curate", "sft", "sample", "dpo", mode="before")(flatten_overrides)

    @field_validator("curate", "sft", "sample", "dpo")
    @classmethod
    def _known_keys(cls, overrides: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Merged over the stage's own overrides key by key, so they name keys of the same recipe."""
        return check_overrides(info.field_name, overrides)


class FlywheelRecipe(StrictModel):
    recipe: Literal["flywheel"] = "flywheel"
    run_dir: str = "runs/quickstart"
    seed: int = 0
    rounds: int = Field(default=1, ge=1, le=10, description="Flywheel turns; round k+1 learns from round k's failures.")
    feedback: FeedbackLoopSpec = Field(default_factory=FeedbackLoopSpec)
    next_round: NextRoundSpec = Field(default_factory=NextRoundSpec)
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

    _stages = field_validator("curate", "sft", "sample", "dpo", "grpo")(_checked_stage)


register_recipe(
    "flywheel",
    FlywheelRecipe,
    "posttrain.flywheel.run:run_flywheel",
    "Flywheel rounds: curate → SFT (curriculum) → rejection sampling → DPO → eval → report; `rounds: N` "
    "feeds each round's failures, annotated through the feedback service, into the next.",
)
