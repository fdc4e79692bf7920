"""Counting host syncs: the Tensor methods that copy a value to the host, counted while the loop runs an update.

Wrapping these methods is instrumentation of the real code path, not a stand-in for it: every call still
goes to torch. Counting is switched on only inside ``posttrain.train.loop._update`` (forward, backward,
clip, health check, optimizer step), so data loading and logging — host work on purpose — do not count.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from posttrain.train import loop

# Each of these copies a tensor's value to the host: on an accelerator, a wait for the device.
# ``__bool__`` is left out on purpose: in the step it comes from the preference losses' length checks, which
# run only on CPU tensors (``posttrain.algorithms.preference._host_readable``), and from transformers' mask
# builder (``fast_all`` on the attention mask, once per forward that passes a 2-D mask) — outside posttrain.
SYNC_METHODS = ("item", "tolist", "cpu", "__float__", "__int__")


@contextlib.contextmanager
def count_host_syncs():
    """Yield a Counter of sync-method calls made inside ``loop._update`` (one entry per method name)."""
    counts: Counter[str] = Counter()
    inside = [0]
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            if inside[0]:
                counts[name] += 1
            return original(self, *args, **kwargs)
        return wrapper

    update = loop._update

    def counted_update(*args, **kwargs):
        inside[0] += 1
        try:
            return update(*args, **kwargs)
        finally:
            inside[0] -= 1

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    loop._update = counted_update
    try:
        yield counts
    finally:
        loop._update = update
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
