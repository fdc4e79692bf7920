"""What the loop needs of a mixture-of-experts policy: its routing, read with forward hooks while the loss runs.

``Routing`` hooks every router of the model (``posttrain.models.moe.routers``) and the decoder's forward (for
the attention mask: padding is routed too, but never counted). The loop opens ``capture()`` around each
micro-batch's loss forward only — not around sampling, evaluation or an activation-checkpointing recompute —
and only forwards with gradients on are read (a reference or old-policy forward under ``no_grad`` is not the
policy being trained). After the forward, ``take()`` gives:

- the weighted router losses of the micro-batch as a *sum over its real tokens* (``posttrain.algorithms.router``:
  each per-sequence loss times the sequence's tokens, averaged over MoE layers). The loop divides it by the
  update's token count over all ranks, like every loss, so accumulation and the rank count leave the gradient
  unchanged;
- detached statistics — tokens, the unweighted loss sums, the tokens each expert of each layer received —
  that travel in the loop's one all-reduce and host copy per update. ``balance()`` then applies DeepSeek-V3's
  bias update from the update's global load, and ``log_fields()`` turns a step's statistics into
  ``moe/…`` fields of ``metrics.jsonl``.

A model without routers gets no ``Routing`` at all (``for_model`` returns ``None``): a dense run pays nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from posttrain.algorithms.router import (
    BALANCE_LOSSES,
    aux_free_bias_update,
    expert_load,
    load_entropy,
    router_z_loss,
)
from posttrain.models.moe import BIAS, MoeArch, check_moe_settings, decoders, num_experts, routers


def check_moe_model(model_config) -> None:
    """``model.moe`` against ``model.path``'s config (its ``config.json`` only, no weights), before any run state
    is written: a dense model with ``model.moe`` set is ``MoeConfigError``, never a silently ignored section."""
    if model_config.moe is None:
        return
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_config.path, trust_remote_code=model_config.trust_remote_code)
    check_moe_settings(hf.model_type, num_experts(hf), model_config.moe, model_config.lora is not None,
                       model_config.path)


def routing_for(lm: torch.nn.Module, model_config) -> Routing | None:
    """The loop's ``Routing`` for the loaded policy ``lm`` (``None`` for a dense model)."""
    hf = lm.config
    arch = check_moe_settings(hf.model_type, num_experts(hf), model_config.moe, model_config.lora is not None,
                              model_config.path)
    return Routing.for_model(lm, arch, model_config.moe)


class Routing:
    def __init__(self, model: torch.nn.Module, arch: MoeArch | None, aux_loss_weight: float = 0.0,
                 z_loss_weight: float = 0.0, bias_update_rate: float = 0.0):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError("Routing needs a model with MoE routers")
        self.layer_ids = [layer for layer, _ in self.routers]
        self.experts = self.routers[0][1].weight.shape[0]
        self.balance = BALANCE_LOSSES.get(arch.balance_loss) if arch is not None and aux_loss_weight > 0 else None
        self.aux_weight, self.z_weight, self.rate = aux_loss_weight, z_loss_weight, bias_update_rate
        config = getattr(model, "config", None)
        pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
        # Without a 2-D attention mask, padding is told by its id — unless padding is the end-of-sequence token,
        # which real tokens use too (then every position counts).
        self.pad_id = pad if pad is not None and pad != eos and not isinstance(eos, list) else None
        # The thread running the loss forward: a rollout engine may sample from the same modules in another
        # thread meanwhile (GRPO's background rollouts), and its forwards must not touch this one's mask.
        self.owner: int | None = None
        self.mask: torch.Tensor | None = None
        self._reset()
        self.handles = [d.register_forward_pre_hook(self._read_mask, with_kwargs=True) for d in decoders(model)]
        self.handles += [router.register_forward_hook(self._hook(index)) for index, (_, router) in
                         enumerate(self.routers)]

    @classmethod
    def for_model(cls, model: torch.nn.Module, arch: MoeArch | None, moe) -> Routing | None:
        """Hooks for an MoE ``model`` with ``model.moe`` (``moe``: a ``MoeConfig`` or ``None``); ``None`` for a
        dense one."""
        if not routers(model):
            return None
        if moe is None:
            return cls(model, arch)
        return cls(model, arch, moe.aux_loss_weight, moe.z_loss_weight, moe.bias_update_rate)

    @property
    def has_loss(self) -> bool:
        return self.balance is not None or self.z_weight > 0

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # ------------------------------------------------------------------ hooks

    def _reset(self) -> None:
        self.captured: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.loss_sum: torch.Tensor | None = None
        self.tokens = self.aux_sum = self.z_sum = None
        self.load: list[torch.Tensor | None] = [None] * len(self.routers)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        self.owner = threading.get_ident()
        try:
            yield
        finally:
            self.owner, self.mask = None, None

    @property
    def armed(self) -> bool:
        return self.owner == threading.get_ident()

    def _read_mask(self, module, args, kwargs) -> None:  # noqa: ARG002 - forward pre-hook signature
        if not self.armed:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        attention_mask = kwargs.get("attention_mask")
        if input_ids is None:
            raise ValueError("MoE routing statistics need the decoder called with input_ids")
        if attention_mask is not None and attention_mask.dim() == 2:
            self.mask = attention_mask.to(torch.bool)
        elif self.pad_id is not None:
            self.mask = input_ids != self.pad_id  # e.g. the 4-D prefix-sharing mask of DPO's pair rows
        else:
            self.mask = torch.ones_like(input_ids, dtype=torch.bool)

    def _hook(self, index: int):
        def read(module, args, output) -> None:  # noqa: ARG001 - forward hook signature
            if not self.armed or not torch.is_grad_enabled():
                return
            if self.mask is None:
                raise ValueError("a router ran outside its decoder's forward: no attention mask to count tokens by")
            # Kept as they are and computed on in take(), after the forward: work done here would run inside an
            # activation-checkpointed block and save tensors its recomputation (hooks disarmed) does not.
            logits, _, selected = output
            self.captured.append((index, logits, selected, self.mask))

        return read

    def _add(self, index: int, logits: torch.Tensor, selected: torch.Tensor, mask: torch.Tensor) -> None:
        """One router's forward: its losses as token sums (averaged over layers) and its load."""
        counts = mask.to(torch.float32).sum(dim=1)  # n_r, real tokens per row
        layers = len(self.routers)
        terms = []
        if self.balance is not None:
            aux = (self.balance(logits, selected, mask) * counts).sum() / layers
            terms.append(self.aux_weight * aux)
            self.aux_sum = _plus(self.aux_sum, aux.detach())
        if self.z_weight > 0:
            z = (router_z_loss(logits, mask) * counts).sum() / layers
            terms.append(self.z_weight * z)
            self.z_sum = _plus(self.z_sum, z.detach())
        if terms:
            self.loss_sum = _plus(self.loss_sum, sum(terms))
        self.load[index] = _plus(self.load[index], expert_load(selected.detach(), mask, self.experts))
        if index == 0:
            self.tokens = _plus(self.tokens, counts.sum())

    # ------------------------------------------------------------------ per micro-batch, per update, per step

    def take(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(weighted loss as a token sum, or None; detached statistics [3 + layers·E], float64)`` of the
        forwards since the last call; statistics are zero when the micro-batch ran no grad-enabled forward."""
        for index, logits, selected, mask in self.captured:
            rows, width = mask.shape
            self._add(index, logits.reshape(rows, width, -1), selected.reshape(rows, width, -1), mask)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        head = [zero if v is None else v.to(device, torch.float64) for v in (self.tokens, self.aux_sum, self.z_sum)]
        load = [torch.zeros(self.experts, dtype=torch.float64, device=device) if v is None
                else v.to(device, torch.float64) for v in self.load]
        loss = self.loss_sum
        self._reset()
        return loss, torch.cat([torch.stack(head), *load])

    def balance_step(self, stats: list[float]) -> None:
        """After an accepted update: DeepSeek-V3's bias update from its load over every micro-batch and rank
        (``stats``: the update's global statistics, on the host). The same numbers on every rank, so every
        rank's copy of each bias moves alike."""
        if self.rate <= 0:
            return
        loads = self._loads(stats)
        with torch.no_grad():
            for (_, router), load in zip(self.routers, loads, strict=True):
                bias = getattr(router, BIAS)
                bias.copy_(aux_free_bias_update(bias, torch.tensor(load), self.rate))

    def _loads(self, stats: list[float]) -> list[list[float]]:
        body = stats[3:]
        return [body[i * self.experts:(i + 1) * self.experts] for i in range(len(self.routers))]

    def log_fields(self, stats: list[float]) -> dict[str, Any]:
        """``moe/…`` fields of a step record from its statistics summed over updates: per layer the most and
        the mean tokens an expert received and the load's normalised entropy; the unweighted router losses
        per token. Dropped tokens: none — transformers' MoE
        layers have no expert capacity (every routed token is computed), so there is nothing to report."""
        tokens, aux, z = stats[:3]
        record: dict[str, Any] = {}
        worst = 0.0
        for layer, load in zip(self.layer_ids, self._loads(stats), strict=True):
            mean = sum(load) / len(load)
            record[f"moe/layer{layer}/load_max"] = max(load)
            record[f"moe/layer{layer}/load_mean"] = mean
            record[f"moe/layer{layer}/load_entropy"] = float(load_entropy(torch.tensor(load)))
            worst = max(worst, max(load) / mean if mean > 0 else 0.0)
        record["moe/load_max_over_mean"] = worst
        if self.balance is not None and tokens > 0:
            record["moe/aux_loss"] = aux / tokens
        if self.z_weight > 0 and tokens > 0:
            record["moe/z_loss"] = z / tokens
        return record


def _plus(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if total is None else total + value
