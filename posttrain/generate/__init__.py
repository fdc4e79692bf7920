"""Sampling engine shared by evaluation, rejection sampling and RL (HF everywhere; vLLM on GPU)."""

from posttrain.generate.engine import (
    BACKENDS,
    Backend,
    Completion,
    HFBackend,
    SamplingParams,
    encode_prompt,
    get_backend,
    render_prompt,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "Completion",
    "HFBackend",
    "SamplingParams",
    "encode_prompt",
    "get_backend",
    "render_prompt",
]
