"""The one autocast rule: when a forward runs under ``torch.autocast``.

- ``precision: fp32``: never (every pass — policy, reference, evaluation — computes in float32).
- ``precision: bf16`` on a module FSDP2 shards: never; its ``MixedPrecisionPolicy`` casts the gathered
  parameters to bf16 and reduces gradients in fp32. Autocast on top would cast a second time.
- ``precision: bf16`` on an unsharded module (one process, or the frozen reference each rank keeps
  whole): autocast to bf16, so its numbers match what the sharded policy computes.
"""

from __future__ import annotations

import contextlib

import torch


def autocast(precision: str, sharded: bool):
    """A context manager for a forward of a module in ``precision``; ``sharded`` = the module is under FSDP."""
    if precision != "bf16" or sharded:
        return contextlib.nullcontext()
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
