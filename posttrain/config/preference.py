"""Config for preference alignment: the ``dpo`` recipe (DPO-family losses) and the ``rm`` recipe
(Bradley–Terry reward model). Both read preference pairs and train through the shared loop.

The validators read what each loss needs from ``posttrain.algorithms.preference_specs``, a table
without torch, so validating a recipe (and ``--help``) stays fast.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config.loader import StrictModel
from posttrain.config.recipes import TrainingRecipe
from posttrain.config.registry import register_recipe
from posttrain.config.sections import DataConfig, TrainConfig

_PREFERENCE_FORMATS = ("auto", "preference", "preference_conversational")
# Loss parameters a user may set in the ``dpo:`` section; each is checked against LOSS_SPECS.
_LOSS_PARAMS = ("simpo_gamma", "orpo_lambda", "bco_delta")


class PreferenceDataConfig(DataConfig):
    """``data:`` for preference pairs. Same keys as SFT data, with preference defaults."""

    truncation_side: Literal["right", "left"] = Field(
        default="left",
        description="Which end of the *prompt* is cut when a pair is too long (the response is kept whole "
        "while it fits): left drops the oldest prompt tokens.",
    )

    @model_validator(mode="after")
    def _check_preference(self) -> PreferenceDataConfig:
        if not self.train:
            raise ValueError("data.train is required: a .jsonl/.parquet file or a saved dataset of preference pairs")
        if self.format not in _PREFERENCE_FORMATS:
            raise ValueError(
                f"data.format={self.format} is not preference data; use {', '.join(_PREFERENCE_FORMATS)}"
            )
        if self.packing:
            raise ValueError(
                "data.packing is not used for preference pairs (chosen and rejected share one row through "
                "dpo.prefix_sharing instead); set data.packing=false"
            )
        return self


class PreferenceTrainConfig(TrainConfig):
    """``train:`` for preference pairs: as for SFT, with the gated-MLP recompute on by default (a pair's two
    responses make the MLP activations the largest tensors a step keeps)."""

    recompute_mlp: bool = Field(
        default=True,
        description="Gated MLPs recompute act(gate)*up and the down projection in backward: two fewer "
        "[tokens, intermediate] tensors kept per block for ~3% more compute.",
    )


class DPOConfig(StrictModel):
    loss: str | list[str] = Field(
        default="sigmoid", description="A loss name from posttrain.algorithms.preference.LOSSES, or a list of them."
    )
    loss_weights: list[float] | None = Field(
        default=None, description="One weight per loss in dpo.loss (default: 1 each)."
    )
    beta: float = Field(default=0.1, gt=0, description="β: the inverse strength of the pull toward the reference.")
    label_smoothing: float = Field(
        default=0.0, ge=0.0, lt=0.5, description="ε for cdpo (smoothing) and robust (label-flip rate)."
    )
    sft_weight: float = Field(
        default=0.0, ge=0.0, description="α of the auxiliary per-token NLL on the chosen response (RPO; Llama 3: 0.2)."
    )
    reference: Literal["precomputed", "live", "none"] | None = Field(
        default=None,
        description="precomputed: one pass before training, cached (see reference_cache_dir), reference model freed; "
        "live: keep the reference model and run it every step; none: reference-free losses. "
        "Default: precomputed when a chosen loss needs a reference, else none.",
    )
    reference_model: str | None = Field(default=None, description="Reference model directory; default: model.path.")
    reference_batch_size: int = Field(default=16, ge=1, description="Pairs per forward in the precompute pass.")
    reference_cache_dir: str | None = Field(
        default=None,
        description="Where the reference log-prob cache lives; default: $XDG_CACHE_HOME/posttrain/reference "
        "(~/.cache/posttrain/reference), or <output_dir>/ref_cache when that is not writable.",
    )
    prefix_sharing: bool = Field(
        default=True,
        description="Run the prompt shared by chosen and rejected once per pair (one row: prompt, chosen, "
        "rejected, with an attention mask that keeps the two responses apart).",
    )
    min_pairs: int = Field(
        default=64, ge=1,
        description="Fewer usable training pairs stop the run (exit 2; a flywheel skips its DPO stage): DPO over a "
        "handful memorises them and its held-out gain is noise. Lower it to train on a small set knowingly; "
        "over fewer than 64 pairs the passes are then capped at 4 (a warning says so).",
    )
    simpo_gamma: float | None = Field(default=None, description="SimPO target margin γ (default 0.5).")
    orpo_lambda: float | None = Field(default=None, ge=0.0, description="ORPO odds-ratio weight λ (default 0.1).")
    bco_delta: float | None = Field(
        default=None, description="BCO reward shift δ; default: the running mean of the rewards (as in the paper)."
    )

    @field_validator("loss", mode="before")
    @classmethod
    def _names_as_list(cls, value):
        return [value] if isinstance(value, str) else value

    @property
    def losses(self) -> list[str]:
        return [self.loss] if isinstance(self.loss, str) else list(self.loss)

    def loss_params(self) -> dict[str, float]:
        """The loss keyword parameters to pass to ``combine_losses`` (beta and label_smoothing always)."""
        params = {"beta": self.beta, "label_smoothing": self.label_smoothing}
        params.update({key: getattr(self, key) for key in _LOSS_PARAMS if getattr(self, key) is not None})
        return params

    def needs_reference(self) -> bool:
        from posttrain.algorithms.preference_specs import LOSS_SPECS

        return any(LOSS_SPECS[name].needs_reference for name in self.losses)

    @property
    def reference_mode(self) -> str:
        if self.reference is not None:
            return self.reference
        return "precomputed" if self.needs_reference() else "none"

    @model_validator(mode="after")
    def _check(self) -> DPOConfig:
        from posttrain.algorithms.preference_specs import LOSS_SPECS, check_loss_params, loss_spec
        from posttrain.algorithms.registry import UnknownNameError

        names = self.losses
        if not names:
            raise ValueError("dpo.loss: name at least one loss, e.g. sigmoid")
        for name in names:
            try:
                loss_spec(name)
            except UnknownNameError as exc:
                raise ValueError(f"dpo.loss: {exc}") from None
        if len(set(names)) != len(names):
            raise ValueError(f"dpo.loss lists a loss twice: {names}; give each once and weight it with dpo.loss_weights")
        if self.loss_weights is not None and len(self.loss_weights) != len(names):
            raise ValueError(
                f"dpo.loss_weights has {len(self.loss_weights)} weights for {len(names)} losses {names}; give one per loss"
            )
        set_params = {key: getattr(self, key) for key in _LOSS_PARAMS if getattr(self, key) is not None}
        try:
            check_loss_params(names, set_params)
        except ValueError as exc:
            raise ValueError(f"dpo: {exc}; remove it or add a loss that reads it to dpo.loss") from None
        if self.label_smoothing > 0 and not any("label_smoothing" in LOSS_SPECS[n].params for n in names):
            raise ValueError(
                f"dpo.label_smoothing={self.label_smoothing} is not read by {', '.join(names)}; "
                "it is used by cdpo (smoothing) and robust (flip rate): use one of them or set it to 0"
            )
        needs = [n for n in names if LOSS_SPECS[n].needs_reference]
        if self.reference == "none" and needs:
            raise ValueError(
                f"dpo.reference=none but {', '.join(needs)} compare the policy with a reference model; "
                "use dpo.reference=precomputed (default) or live, or a reference-free loss (simpo, orpo)"
            )
        if self.reference in ("precomputed", "live") and not needs:
            raise ValueError(
                f"dpo.reference={self.reference} but {', '.join(names)} never read reference log-probs; "
                "set dpo.reference=none (or leave it unset)"
            )
        if self.reference_model is not None and not needs:
            raise ValueError("dpo.reference_model is set but no chosen loss uses a reference; remove it")
        return self


class DPORecipe(TrainingRecipe):
    recipe: Literal["dpo"] = "dpo"
    data: PreferenceDataConfig
    train: PreferenceTrainConfig = Field(default_factory=PreferenceTrainConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)


class RewardModelConfig(StrictModel):
    holdout_fraction: float = Field(
        default=0.1,
        ge=0.0,
        lt=1.0,
        description="Without data.eval, hold out this fraction of the pairs (chosen by a hash of the pair id) "
        "for the held-out pairwise accuracy.",
    )
    score_margin: bool = Field(
        default=False,
        description="Llama 2's margin loss: require r_c − r_r ≥ chosen_score − rejected_score (pairs need both scores).",
    )
    prefix_sharing: bool = Field(default=True, description="As dpo.prefix_sharing: one row per pair.")


class RewardModelRecipe(TrainingRecipe):
    recipe: Literal["rm"] = "rm"
    data: PreferenceDataConfig
    train: PreferenceTrainConfig = Field(default_factory=PreferenceTrainConfig)
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig)

    @model_validator(mode="after")
    def _check(self) -> RewardModelRecipe:
        if self.rm.holdout_fraction == 0 and not self.data.eval:
            raise ValueError(
                "the reward model needs held-out pairs for its accuracy: set data.eval or rm.holdout_fraction > 0"
            )
        return self


register_recipe(
    "dpo", DPORecipe, "posttrain.train.dpo:run_dpo",
    "Preference alignment with DPO-family losses (DPO, IPO, SimPO, ORPO, …) on preference pairs.",
)
register_recipe(
    "rm", RewardModelRecipe, "posttrain.train.reward_model:run_reward_model",
    "Bradley–Terry reward model (LM + scalar head) trained on preference pairs.",
)
