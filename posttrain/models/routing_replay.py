"""Rollout routing replay (R3) for RL on mixture-of-experts models: the experts each token was routed to at
sampling time, recorded, and forced in the training forward.

**Why.** An MoE router picks its top-K experts by comparing scores; two forwards that differ by float noise
(bf16 sampling and fp32 training, a KV-cache decode and a full-sequence forward, another kernel) pick
different experts for the tokens whose scores nearly tie, and then compute *different functions* of the same
weights. The importance ratio ``π_train / π_sampler`` of those tokens is no longer 1 at the first update, and the
policy gradient is taken through experts the sample never used. Rollout routing replay (Ma et al. 2025,
"Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers", arXiv:2510.11370) records
the sampler's choice per token and layer and makes the training forward use it.

**What is replayed.** Only the *choice* of experts. The router still computes its logits in the training forward
(so it gets a gradient through its weights) and the gate weights are the architecture's gating function
evaluated *at the recorded experts* (``GATES``: pure functions, one per architecture in ``MOE_ARCHS``):

- ``qwen3_moe``: ``p = softmax(logits)`` over all experts, gathered at the recorded ids, renormalised over
  them when ``norm_topk_prob``;
- ``deepseek_v3``: ``s = sigmoid(logits)`` gathered at the recorded ids, normalised (``+1e-20``) when
  ``norm_topk_prob``, times ``routed_scaling_factor``. The selection bias (``e_score_correction_bias``) only
  chooses, so it has no part in the replayed weights — the recorded choice already holds its effect.

**Layout.** A rollout's ``routed_experts`` is an ``int16`` array ``[prompt + completion tokens, MoE layers, K]``
(the layout vLLM's ``CompletionOutput.routed_experts`` uses): row ``t`` is the experts token ``t`` was sent to
in each MoE layer, in ``routers(model)`` order. ``UNROUTED`` (−1) marks a token the sampler never ran through the
model — the last completion token, which is sampled but never fed back — and, in a training batch, padding:
there the training forward routes as it likes (neither changes a trained log-prob: under causal attention a
position only affects later ones).

``RoutingRecorder`` fills it during ``HFBackend``'s decode; ``RoutingReplay`` forces it in the training forward
(and in the trainer's log-prob recompute, ``posttrain.rl.offpolicy``) and measures the routing agreement: the
share of (token, layer) pairs whose own top-K in the training forward equals the recorded set.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from posttrain.models.moe import MOE_ARCHS, MoeConfigError, routers

UNROUTED = -1
DTYPE = np.int16  # expert ids up to 32767 (DeepSeek-V3: 256, Kimi K2: 384)


# ----------------------------------------------------------------------------- gates at given experts


def qwen3_moe_gate(logits: torch.Tensor, experts: torch.Tensor, *, normalize: bool) -> torch.Tensor:
    """Qwen3-MoE's gate weights at ``experts``: ``softmax(logits)[experts]`` (float32), divided by their sum when
    ``normalize`` (``norm_topk_prob``); in ``logits.dtype``. ``logits [N, E]``, ``experts [N, K]`` → ``[N, K]``.
    At the router's own top-K this is exactly ``Qwen3MoeTopKRouter``'s ``router_scores``."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def deepseek_v3_gate(logits: torch.Tensor, experts: torch.Tensor, *, normalize: bool, scale: float) -> torch.Tensor:
    """DeepSeek-V3's gate weights at ``experts``: ``sigmoid(logits)[experts]``, divided by ``their sum + 1e-20``
    when ``normalize``, times ``scale`` (``routed_scaling_factor``). ``[N, E]``, ``[N, K]`` → ``[N, K]``. The
    correction bias is not in it: DeepSeek-V3 adds it to choose, and weighs with the unbiased scores."""
    weights = logits.sigmoid().gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale


GATES: dict[str, Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "qwen3_moe": lambda router, logits, experts: qwen3_moe_gate(logits, experts, normalize=router.norm_topk_prob),
    "deepseek_v3": lambda router, logits, experts: deepseek_v3_gate(
        logits, experts, normalize=router.norm_topk_prob, scale=router.routed_scaling_factor),
}
assert set(GATES) == set(MOE_ARCHS), "every architecture posttrain routes needs its gate here"


def check_replayable(model_type: str, experts: int | None, where: str) -> None:
    """``rl.routing_replay`` against the policy (``where``: its path): ``MoeConfigError`` for a dense model or an
    architecture whose gate is not in ``GATES``."""
    if experts is None:
        raise MoeConfigError(f"rl.routing_replay is set but {where} is a dense {model_type} model (no router to "
                             "replay): set rl.routing_replay=false, or train a mixture-of-experts model")
    if model_type not in GATES:
        raise MoeConfigError(f"rl.routing_replay: posttrain has no gate function for {model_type} routers ({where}); "
                             f"it replays {', '.join(sorted(GATES))}. Set rl.routing_replay=false, or add the "
                             "architecture to posttrain.models.routing_replay.GATES")


def _moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    found = [router for _, router in routers(model)]
    if not found:
        raise MoeConfigError("routing replay needs a mixture-of-experts model: this one has no router")
    return found


# ----------------------------------------------------------------------------- recording at sampling time


class RoutingRecorder:
    """The experts every router chose during one ``HFBackend`` decode, per row of the batch.

    The backend calls ``prefill(attention, source)`` after its prefill forward (the distinct prompts,
    left-padded; ``source[row]`` = the distinct prompt a row samples from), ``decode(active)`` after each decode
    forward (``active``: the batch rows the forward ran, in its order), and ``result(row, completion_length)`` at
    the end. Only forwards on the thread that made it are recorded. ``close()`` removes the hooks.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = _moe_routers(model)
        self.owner = threading.get_ident()
        self.rows: list[list[torch.Tensor]] = []
        self._chosen: list[torch.Tensor | None] = [None] * len(self.routers)
        self.handles = [router.register_forward_hook(self._hook(index)) for index, router in enumerate(self.routers)]

    def _hook(self, index: int):
        def read(module, args, output) -> None:  # noqa: ARG001 - forward hook signature
            if threading.get_ident() == self.owner:
                self._chosen[index] = output[2].detach()

        return read

    def _take(self) -> torch.Tensor:
        """``[tokens, layers, K]`` of the last forward, on the host."""
        if any(chosen is None for chosen in self._chosen):
            raise RuntimeError("routing replay: a forward ran without every MoE router")
        chosen = torch.stack([c.to("cpu", torch.int16) for c in self._chosen], dim=1)  # type: ignore[union-attr]
        self._chosen = [None] * len(self.routers)
        return chosen

    def prefill(self, attention: torch.Tensor, source: Sequence[int]) -> None:
        chosen = self._take()
        distinct, width = attention.shape
        chosen = chosen.view(distinct, width, *chosen.shape[1:])
        real = attention.to("cpu", torch.bool)
        prompts = [chosen[u][real[u]] for u in range(distinct)]  # left padding dropped
        self.rows = [[prompts[u]] for u in source]

    def decode(self, active: Sequence[int]) -> None:
        chosen = self._take()
        if chosen.shape[0] != len(active):
            raise RuntimeError(f"routing replay: a decode step routed {chosen.shape[0]} tokens for {len(active)} rows")
        for j, row in enumerate(active):
            self.rows[row].append(chosen[j : j + 1])

    def result(self, row: int, completion_length: int) -> np.ndarray:
        """Row ``row``'s ``[prompt + completion_length, layers, K]`` int16; its last token ``UNROUTED``."""
        parts = self.rows[row]
        routed = torch.cat(parts, dim=0)
        decoded = len(parts) - 1
        if decoded != completion_length - 1:
            raise RuntimeError(f"routing replay: row {row} fed {decoded} sampled tokens back, expected "
                               f"{completion_length - 1}")
        last = torch.full((1, *routed.shape[1:]), UNROUTED, dtype=torch.int16)
        return torch.cat([routed, last]).numpy().astype(DTYPE, copy=False)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@contextlib.contextmanager
def recording(model: torch.nn.Module, on: bool) -> Iterator[RoutingRecorder | None]:
    """A ``RoutingRecorder`` on ``model`` for the block when ``on`` (else ``None``), its hooks removed after."""
    if not on:
        yield None
        return
    recorder = RoutingRecorder(model)
    try:
        yield recorder
    finally:
        recorder.close()


def routing_layout(arrays: Sequence[np.ndarray], width: int) -> torch.Tensor:
    """``[B, width, layers, K]`` int16: each rollout's ``routed_experts`` at its tokens' positions of a right-padded
    batch, ``UNROUTED`` on padding."""
    shapes = {array.shape[1:] for array in arrays}
    if len(shapes) != 1:
        raise ValueError(f"routed experts of one batch have different layer / top-K shapes: {sorted(shapes)}")
    out = np.full((len(arrays), width, *shapes.pop()), UNROUTED, dtype=DTYPE)
    for b, array in enumerate(arrays):
        out[b, : array.shape[0]] = array
    return torch.from_numpy(out)


# ----------------------------------------------------------------------------- replay in the training forward


class RoutingReplay:
    """Forces recorded experts on every router of ``model`` (``model_type`` names its gate in ``GATES``).

    ``load(routed)`` (``[B, T, layers, K]``, ``routing_layout``) before a training forward of a ``[B, T]`` batch:
    every grad-enabled forward after it is replayed — the forward itself and an activation-checkpointing
    recompute during backward, which runs after the loss function returned — until the next ``load``.
    ``forced(routed)`` replays the forwards of a block whatever the grad mode (the trainer's log-prob recompute,
    under ``no_grad``). Forwards without gradient outside ``forced`` (sampling, evaluation, a frozen reference)
    route freely. ``agreement(shape)``: per position, the share of MoE layers whose own top-K equalled the
    recorded experts in the forwards since ``load`` (1 where nothing was recorded); a detached tensor.
    """

    def __init__(self, model: torch.nn.Module, model_type: str):
        self.routers = _moe_routers(model)
        self.gate = GATES[model_type]
        self.routed: torch.Tensor | None = None
        self.force = False
        self._agree: torch.Tensor | None = None
        self._calls = 0
        self.handles = [router.register_forward_hook(self._hook(index)) for index, router in enumerate(self.routers)]

    def load(self, routed: torch.Tensor | None) -> None:
        if routed is None:
            raise ValueError("rl.routing_replay: this batch carries no recorded routing (rollouts sampled without "
                             "rl.routing_replay, e.g. queued in a checkpoint written before it was set); resume "
                             "with the setting the run started with")
        if routed.dim() != 4 or routed.shape[2] != len(self.routers):
            raise ValueError(f"recorded routing of shape {list(routed.shape)} does not fit this model's "
                             f"{len(self.routers)} MoE layers ([batch, tokens, layers, K] expected)")
        self.routed, self._agree, self._calls = routed, None, 0

    def unload(self) -> None:
        self.routed, self._agree, self._calls = None, None, 0

    @contextlib.contextmanager
    def forced(self, routed: torch.Tensor | None) -> Iterator[None]:
        self.load(routed)
        self.force = True
        try:
            yield
        finally:
            self.force = False
            self.unload()

    def _hook(self, index: int):
        def replay(module, args, output):  # noqa: ARG001 - forward hook signature
            if self.routed is None or not (self.force or torch.is_grad_enabled()):
                return None
            logits, weights, chosen = output
            top_k = chosen.shape[-1]
            recorded = self.routed[:, :, index, :]
            if recorded.shape[0] * recorded.shape[1] != logits.shape[0] or recorded.shape[-1] != top_k:
                raise ValueError(f"recorded routing [{recorded.shape[0]}, {recorded.shape[1]}, ·, "
                                 f"{recorded.shape[-1]}] does not fit a router forward of {logits.shape[0]} tokens, "
                                 f"top-{top_k}: the batch and its routing must be laid out alike (routing_layout)")
            recorded = recorded.reshape(-1, top_k).to(chosen.device, torch.long)
            known = recorded[:, :1] >= 0
            experts = torch.where(known, recorded, chosen)
            replayed = torch.where(known, self.gate(module, logits, experts).to(weights.dtype), weights)
            with torch.no_grad():
                same = (chosen.sort(dim=-1).values == experts.sort(dim=-1).values).all(dim=-1)
                self._agree = same.float() if self._agree is None else self._agree + same.float()
                self._calls += 1
            return logits, replayed, experts.to(chosen.dtype)

        return replay

    def agreement(self, shape: Sequence[int]) -> torch.Tensor:
        """``shape`` (``[B, T]``) float32: per position the share of MoE layers whose own top-K was the recorded one."""
        if self._agree is None:
            raise RuntimeError("routing replay: no replayed forward since load()")
        return (self._agree / self._calls).view(*shape)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
