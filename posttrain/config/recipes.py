"""Top-level recipe schemas. Each registers under the name its YAML gives in ``recipe:``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.loader import StrictModel
from posttrain.config.registry import register_recipe
from posttrain.config.sections import (
    AlertsConfig,
    DataConfig,
    DebugConfig,
    HealthConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    StoreConfig,
    TrainConfig,
)


class TrainingRecipe(StrictModel):
    """Fields every training recipe shares (SFT, pretrain, DPO, reward model)."""

    output_dir: str = Field(description="Where the run lives: a local directory or a URL (s3://bucket/prefix).")
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)

    @model_validator(mode="after")
    def _expert_adapters_unsharded(self) -> TrainingRecipe:
        # peft's expert adapter computes one update for all E experts of a layer and adds it to the stacked weight;
        # under expert parallelism each rank holds E / parallel.expert of them as a DTensor shard, and an update of
        # the whole stack cannot be added to a shard of it.
        lora = self.model.lora
        if lora is not None and lora.experts and self.parallel.expert > 1:
            raise ValueError(f"model.lora.experts with parallel.expert={self.parallel.expert}: peft's expert adapters "
                             "cover every expert of a layer and cannot be added to the expert-parallel shards; use "
                             "parallel.expert=1 (FSDP2 shards the experts and their adapters), or "
                             "model.lora.experts=false to adapt the attention only")
        return self


class SFTRecipe(TrainingRecipe):
    recipe: Literal["sft"] = "sft"

    @model_validator(mode="after")
    def _check(self) -> SFTRecipe:
        if not self.data.train:
            raise ValueError("data.train is required for SFT: a .jsonl/.parquet file or a saved dataset")
        if self.data.format in ("preference", "preference_conversational", "rl"):
            raise ValueError(f"data.format={self.data.format} is not SFT data; use messages/sharegpt/alpaca/auto")
        return self


register_recipe("sft", SFTRecipe, "posttrain.train.sft:run_sft", "Supervised fine-tuning with a curriculum.")


class PretrainDataConfig(DataConfig):
    """``data:`` for plain text: documents are always packed into rows."""

    packing: bool = Field(default=True, description="Always on: documents are packed into train.max_length rows.")

    @model_validator(mode="after")
    def _check_text(self) -> PretrainDataConfig:
        if not self.train:
            raise ValueError("data.train is required: a .txt file (one document per line) or JSONL with a `text` field")
        if not self.packing:
            raise ValueError("pretraining always packs documents into rows; remove data.packing=false")
        if self.curriculum != "none":
            raise ValueError("plain text has no tiers: set data.curriculum=none for pretraining")
        return self


class PretrainRecipe(TrainingRecipe):
    """Causal-LM training on plain text (every token carries loss); rows are always packed."""

    recipe: Literal["pretrain"] = "pretrain"
    data: PretrainDataConfig


register_recipe(
    "pretrain", PretrainRecipe, "posttrain.train.pretrain:run_pretrain", "Causal-LM training on plain text."
)
