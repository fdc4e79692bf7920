"""Typed config section ``generate:`` for recipes and commands that sample from a model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.config.loader import StrictModel
from posttrain.generate.engine import SamplingParams


class GenerateConfig(StrictModel):
    backend: Literal["hf", "vllm"] = Field(
        default="hf", description="hf works everywhere; vllm needs a GPU and `pip install 'posttrain[vllm]'`."
    )
    n: int = Field(default=1, ge=1, description="Samples per prompt.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k.")
    max_new_tokens: int = Field(default=256, ge=1)
    stop: list[str] = Field(default_factory=list)
    seed: int = 0
    batch_size: int = Field(default=8, ge=1, description="Sequences decoded together (hf backend).")
    dtype: Literal["float32", "bfloat16"] = "float32"

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, stop=list(self.stop), seed=self.seed)
