"""Host memory for what training keeps: pinning only where an accelerator exists, and activation offload.

``train.cpu_offload`` (FSDP2's ``CPUOffloadPolicy``) keeps parameters, gradients and optimizer state on the
host; ``train.activation_offload`` keeps the tensors autograd saves for backward on the host between the
forward and the backward (``ActivationOffload``). Both pin host memory only where an accelerator exists:
``pin_memory()`` needs one, and on a CPU-only machine it raises "Cannot access accelerator device when
none is available" from deep inside FSDP.
"""

from __future__ import annotations

import torch


def accelerator_available() -> bool:
    """Whether pinned (page-locked) host memory can be allocated: an accelerator (CUDA, XPU, …) is present."""
    return torch.accelerator.is_available()


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved activations go to host memory at forward and come back to their device at backward.

    The same copies as torch's ``torch.autograd.graph.save_on_cpu`` (pinned host buffer where an
    accelerator exists; the copy back is non-blocking from pinned memory), with two departures:
    parameters and views of them are not copied (they stay resident anyway — copying them would only add traffic), and
    ``packed``/``unpacked`` count the hook calls and ``offloaded`` the tensors copied to the host, so a run
    (and a test) can see the offload happened.

    With activation checkpointing, non-reentrant checkpointing saves only each checkpointed block's
    inputs through the hooks active at forward (the block's own activations go through the
    checkpoint's hooks and are recomputed), so exactly those inputs move to the host. Enter it around
    the forward only; the backward unpacks through the hooks recorded at pack time.

    On a CPU-only machine host = device: the copy is real but saves nothing (it proves the round trip).
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = accelerator_available() if pin_memory is None else pin_memory
        self.packed = 0
        self.unpacked = 0
        self.offloaded = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        self.packed += 1
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return None, tensor  # a weight or a view of one (a linear saves ``weight.t()``): resident anyway
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                           pin_memory=self.pin_memory and not tensor.is_sparse)
        host.copy_(tensor)
        self.offloaded += 1
        return tensor.device, host

    def _unpack(self, packed) -> torch.Tensor:
        self.unpacked += 1
        device, tensor = packed
        if device is None:  # a parameter, saved as is
            return tensor
        return tensor.to(device, non_blocking=self.pin_memory)
