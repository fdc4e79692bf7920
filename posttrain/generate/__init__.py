"""Sampling engine shared by evaluation, rejection sampling and RL (HF everywhere; vLLM on GPU).

The names below live in ``posttrain.generate.engine``, which imports torch. They are loaded on first
use (PEP 562 ``__getattr__``) so that importing ``posttrain.generate.cli`` for ``--help`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("posttrain.generate.engine"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
