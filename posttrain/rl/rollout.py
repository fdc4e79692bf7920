"""Rollouts from the current policy, and the training micro-batch made from them.

``sample_rollouts`` samples ``params.n`` completions per prompt with the generation engine
(``posttrain.generate.engine.HFBackend``) from the weights the loop is training, recording each
token's log-prob at sampling time (the "old" log-probs of a PPO/GRPO ratio). ``rollout_batch`` lays
rollouts out as a right-padded training batch; ``completion_logprobs`` runs the training forward
(``posttrain.models.logprobs.TokenLogprobModel``) and returns its log-probs in the same layout, so
``completion_logprobs(root, batch, T) - batch["old_logprobs"]`` is the log-ratio, position by position.

**Which distribution.** Both sides use ``log softmax(logits / T)`` in float32 with the same ``T``:
the sampler applies the temperature to its logits and records the log-prob of the drawn token
*before* top-p / top-k truncation; the training forward divides its logits by ``T``. With the same
weights the two agree to float32 rounding (tested to 1e-4 on batches with left padding at sampling
time and right padding at training time), so the first update's ratio is 1 and nothing hides a
train/generate mismatch. Greedy sampling (``T = 0``) is refused: it has no sampling distribution for
a ratio to refer to, and its G samples would be one sample repeated.

**What is trained.** ``completion_ids`` are exactly the sampled tokens, *including* the EOS / end-of-turn
token when one was sampled (and the token that completed a stop string): the EOS is a decision of the
policy (stopping) and gets its share of the advantage like any other token, as in TRL's completion
mask. A truncated completion (``max_new_tokens`` reached, ``truncated=True``) has no EOS; whether it is
trained, shaped or masked is the recipe's choice (``batch["truncated"]``).

**Under FSDP2** (``root`` sharded with ``fully_shard`` by ``posttrain.train.parallelize``), the full
weights are gathered once per rollout phase, not once per decoded token: every FSDP module is
unsharded once (one all-gather per FSDP group, ``1 + blocks`` in all) with ``reshard_after_forward``
switched off, the whole decode runs on those unsharded parameters without a collective, and every
module is resharded afterwards. The alternative, loading a full state dict into a per-rank unsharded
replica, needs the same memory (one full copy per rank) plus a second model object, and would not run
in FSDP's ``param_dtype`` as the training forward does. Each rank samples for its own prompts and ranks
never wait on each other during decoding; ``prompt_keys`` (global prompt indices) makes a prompt's
samples independent of which rank drew it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.chat import Prompt, encode_prompt
from posttrain.generate.engine import Completion, HFBackend, SamplingParams
from posttrain.models.logprobs import IGNORE_INDEX, batch_positions, loss_positions

__all__ = ["Rollout", "completion_logprobs", "full_weights", "rollout_batch", "sample_rollouts", "to_rollouts",
           "trained_count", "trained_values"]


@dataclass
class Rollout:
    """One sampled completion of one prompt, with what the loss needs from sampling time.

    ``prompt_ids``: the ids the completion was sampled after (``posttrain.data.chat.encode_prompt``, the
    ids training uses). ``completion_ids``: the sampled tokens, EOS included when sampled.
    ``logprobs[i]``: float32 ``log softmax(logits / temperature)[completion_ids[i]]`` at sampling time.
    ``finish_reason``: "eos", "stop" (a stop string) or "length"; ``truncated`` is ``finish_reason ==
    "length"``. ``text``: the completion decoded without special tokens, cut before a stop string.
    ``prompt_key``: the prompt's seed key (its global index when ``prompt_keys`` was given);
    ``sample_index``: which of the prompt's ``n`` samples this is. ``version``: the policy version that
    sampled it (the loop step whose starting weights it came from); ``train_logprobs``: the trainer's
    log-probs of ``completion_ids`` recomputed with those weights (``posttrain.rl.offpolicy``), or ``None``.
    ``logprobs`` are the behaviour (sampler's) log-probs; the two differ by the training–inference mismatch.
    ``routed_experts``: with ``rl.routing_replay``, the experts each token was routed to at sampling time, int16
    ``[prompt + completion tokens, MoE layers, K]`` (``posttrain.models.routing_replay``); not compared by ``==``.
    """

    prompt_key: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    truncated: bool
    text: str
    temperature: float
    version: int = 0
    train_logprobs: list[float] | None = None
    routed_experts: Any = dataclasses.field(default=None, compare=False, repr=False)
    # Multi-turn episodes (posttrain.rl.multiturn): 1 where completion_ids[i] is the model's (sampled, trained),
    # 0 where the environment wrote it (a tool's output: no sampled log-prob, no loss). None: every token trained.
    loss_mask: list[int] | None = None
    # What the episode did (turns, tool calls, tool errors, seconds, a failure reason); None for one-turn rollouts.
    episode: dict[str, Any] | None = None


def _fsdp_modules(root: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    modules = [module for module in root.modules() if isinstance(module, FSDPModule)]
    if modules and modules[0] is not root:
        raise ValueError("full_weights(root): root must be the FSDP root module (fully_shard(root) last)")
    return modules


@contextmanager
def full_weights(root: torch.nn.Module) -> Iterator[None]:
    """Inside the block every parameter under ``root`` is whole on this rank; a no-op without FSDP.

    Each FSDP module is all-gathered once on entry and resharded on exit; in between its forward hooks
    find it unsharded (no all-gather) and leave it so (``reshard_after_forward`` off). On exit the
    non-root modules get back ``reshard_after_forward=True``, the setting ``parallelize()`` gives them
    (the root keeps FSDP's root default, which this never changes). Collective: every rank must enter.
    """
    modules = _fsdp_modules(root)
    if not modules:
        yield
        return
    # The root's lazy init must run first: it marks the tree's root. Without it the first block to run
    # a forward here would claim to be the root and the next training forward would fail. Idempotent.
    root._get_fsdp_state()._lazy_init()
    blocks = modules[1:]
    for module in blocks:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        handles = [module.unshard(async_op=True) for module in modules]
        for handle in handles:
            if handle is not None:
                handle.wait()
        yield
    finally:
        for module in reversed(modules):
            module.reshard()
        for module in blocks:
            module.set_reshard_after_forward(True, recurse=False)
        _forget_forward_order(root, modules)


def _forget_forward_order(root: torch.nn.Module, modules: list[Any]) -> None:
    """Drop the module order FSDP2 recorded during the forwards inside ``full_weights``.

    FSDP2 appends every forward, no-grad ones too, to an order it keeps until the end of the next backward and
    prefetches along it there (a block's backward all-gathers the block recorded before it). The forwards run
    here differ in number between ranks (each scores or samples its own rollouts), so a rank that ran some would
    prefetch one group more in the next backward than a rank that ran none, and the ranks' collectives would
    pair up wrongly: a hang (measured on 2 gloo ranks: GRPO with the engine and ``rl.measure_mismatch``).
    """
    if hasattr(root, "reset_iter_state"):  # torch >= 2.13: the public way to clear FSDP's per-iteration trackers
        root.reset_iter_state()
        return
    root._get_fsdp_state()._comm_ctx.post_forward_order.clear()
    for module in modules:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            group._post_forward_indices.clear()


def sample_rollouts(
    root: torch.nn.Module,
    lm: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    *,
    batch_size: int,
    progress: bool = False,
    prompt_keys: Sequence[int] | None = None,
) -> list[list[Rollout]]:
    """``params.n`` rollouts per prompt from the current weights of ``lm`` (``root``'s HF model), in prompt order.

    ``root`` is the module the loop trains (the FSDP root when sharded; ``root.lm is lm`` for
    ``TokenLogprobModel``). Generation runs in eval mode without gradients; the train/eval mode is
    restored. ``prompt_keys`` (one distinct int per prompt, default: position) seed each prompt's samples:
    with global prompt indices a prompt gets the same samples on any rank and in any batch
    (``batch_size`` changes speed, not results). Log-probs are always recorded (``params.logprobs`` is
    forced on). Under FSDP this is a collective: every rank calls it, with its own prompts (possibly none).
    """
    if params.greedy:
        raise ValueError(
            "rollouts need sampling (temperature > 0): greedy decoding has no sampling distribution for the "
            "policy ratio and gives every prompt G identical completions"
        )
    params = dataclasses.replace(params, logprobs=True)
    was_training = root.training
    root.eval()
    try:
        with full_weights(root):
            backend = HFBackend(lm, tokenizer)
            completions = backend.generate(list(prompts), params, batch_size=batch_size, progress=progress,
                                           seed_keys=prompt_keys)
    finally:
        root.train(was_training)
    return to_rollouts(tokenizer, prompts, completions, params.temperature, prompt_keys)


def to_rollouts(tokenizer: Any, prompts: Sequence[Prompt], completions: Sequence[Sequence[Completion]],
                temperature: float, prompt_keys: Sequence[int] | None = None) -> list[list[Rollout]]:
    """``Rollout``s from any engine's completions (``posttrain.generate.engine.Backend``), in prompt order: the
    same record whichever engine sampled them (``posttrain.rl.engines``)."""
    keys = list(prompt_keys) if prompt_keys is not None else list(range(len(prompts)))
    rollouts = []
    for prompt, key, samples in zip(prompts, keys, completions, strict=True):
        prompt_ids = encode_prompt(tokenizer, prompt)
        rollouts.append([
            Rollout(prompt_key=key, sample_index=index, prompt_ids=list(prompt_ids),
                    completion_ids=list(c.token_ids), logprobs=list(c.logprobs or []),
                    finish_reason=c.finish_reason, truncated=c.finish_reason == "length", text=c.text,
                    temperature=temperature, routed_experts=c.routed_experts)
            for index, c in enumerate(samples)
        ])
    return rollouts


def rollout_batch(rollouts: Sequence[Rollout], pad_id: int, temperature: float) -> dict[str, torch.Tensor]:
    """One training micro-batch from ``rollouts`` (B of them), right-padded to the longest ``prompt + completion`` (L).

    Returns, all ``[B, L]`` unless said:

    - ``input_ids`` (long): ``prompt_ids + completion_ids``, then ``pad_id``;
    - ``attention_mask`` (long): 1 on real tokens, 0 on padding;
    - ``labels`` (long): the completion tokens at their own positions, ``IGNORE_INDEX`` on the prompt, on
      padding and on an episode's environment tokens (``loss_mask`` 0: tool output is context, never a target)
      (``TokenLogprobModel`` convention: ``labels[:, t]`` is predicted from positions ``< t``);
    - ``completion_mask`` (bool): ``labels != IGNORE_INDEX``;
    - ``old_logprobs`` (float32): at each completion position ``t``, the sampling-time log-prob of
      ``labels[b, t]``; 0 elsewhere. So ``old_logprobs[completion_mask]`` is in the order of the flat
      ``[N]`` log-probs ``TokenLogprobModel`` returns for these labels;
    - ``truncated`` (bool, ``[B]``): the completion hit ``max_new_tokens`` (no EOS);
    - ``routed_experts`` (int16, ``[B, L, layers, K]``), only when the rollouts carry them (``rl.routing_replay``):
      the sampler's experts per token, ``UNROUTED`` on padding (``posttrain.models.routing_replay``).

    ``temperature`` is the one the training forward will use; a rollout sampled at another temperature
    raises, since its old log-probs would be of another distribution.
    """
    if not rollouts:
        raise ValueError("rollout_batch needs at least one rollout")
    for rollout in rollouts:
        if rollout.temperature != temperature:
            raise ValueError(
                f"rollout (prompt {rollout.prompt_key}, sample {rollout.sample_index}) was sampled at temperature "
                f"{rollout.temperature} but the batch is for temperature {temperature}: its old log-probs are of "
                "another distribution; train at the sampling temperature"
            )
        if not rollout.completion_ids or len(rollout.logprobs) != len(rollout.completion_ids) or not rollout.prompt_ids:
            raise ValueError(
                f"rollout (prompt {rollout.prompt_key}, sample {rollout.sample_index}) needs a non-empty prompt, a "
                "non-empty completion and one log-prob per completion token"
            )
        if rollout.loss_mask is not None and (len(rollout.loss_mask) != len(rollout.completion_ids)
                                              or not any(rollout.loss_mask)):
            raise ValueError(
                f"rollout (prompt {rollout.prompt_key}, sample {rollout.sample_index}) needs one loss_mask entry per "
                "completion token and at least one trained (model) token"
            )
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    input_ids, labels, attention, old = [], [], [], []
    for r in rollouts:
        length, pad = len(r.prompt_ids) + len(r.completion_ids), width - len(r.prompt_ids) - len(r.completion_ids)
        input_ids.append(r.prompt_ids + r.completion_ids + [pad_id] * pad)
        trained = (r.completion_ids if r.loss_mask is None
                   else [t if keep else IGNORE_INDEX for t, keep in zip(r.completion_ids, r.loss_mask, strict=True)])
        labels.append([IGNORE_INDEX] * len(r.prompt_ids) + trained + [IGNORE_INDEX] * pad)
        attention.append([1] * length + [0] * pad)
        old.append([0.0] * len(r.prompt_ids) + r.logprobs + [0.0] * pad)
    labels_tensor = torch.tensor(labels, dtype=torch.long)
    batch = {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "attention_mask": torch.tensor(attention, dtype=torch.long),
        "labels": labels_tensor,
        "completion_mask": labels_tensor != IGNORE_INDEX,
        "old_logprobs": torch.tensor(old, dtype=torch.float32),
        "truncated": torch.tensor([r.truncated for r in rollouts], dtype=torch.bool),
    }
    routed = [r.routed_experts for r in rollouts]
    if any(array is not None for array in routed):
        batch["routed_experts"] = _routed_layout(rollouts, width)
    return batch


def _routed_layout(rollouts: Sequence[Rollout], width: int) -> torch.Tensor:
    """``rollout_batch``'s ``routed_experts``: every rollout must carry them, one row per token."""
    from posttrain.models.routing_replay import routing_layout

    for r in rollouts:
        tokens = len(r.prompt_ids) + len(r.completion_ids)
        if r.routed_experts is None or r.routed_experts.shape[0] != tokens:
            raise ValueError(f"rollout (prompt {r.prompt_key}, sample {r.sample_index}) has "
                             f"{'no' if r.routed_experts is None else r.routed_experts.shape[0]} routed-expert rows "
                             f"for {tokens} tokens: a batch replays the routing of all its rollouts or of none")
    return routing_layout([r.routed_experts for r in rollouts], width)


def trained_count(rollout: Rollout) -> int:
    """How many of ``rollout``'s completion tokens the loss sees: all of them, or the model's own in an episode."""
    return len(rollout.completion_ids) if rollout.loss_mask is None else sum(map(bool, rollout.loss_mask))


def trained_values(rollout: Rollout, values: Sequence[float]) -> list[float]:
    """``values`` (one per completion token) at the trained positions only (``loss_mask``)."""
    if rollout.loss_mask is None:
        return list(values)
    return [value for value, keep in zip(values, rollout.loss_mask, strict=True) if keep]


def completion_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float, *, return_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The training forward's log-probs of ``batch["labels"]`` at ``temperature``, laid out like ``old_logprobs``.

    ``model`` is the root the loop trains (``TokenLogprobModel``, FSDP-wrapped or not), so gradients flow
    and FSDP's hooks run as in any training forward. Returns ``[B, L]`` float32 (0 off the completion
    mask), and with ``return_entropy`` also the per-token entropy of ``softmax(logits / T)`` ``[B, L]``
    (detached; 0 off the mask). The attention mask is not passed: with right padding and causal attention
    no real token can see a pad, and without it the attention takes its mask-free causal path.
    """
    labels = batch["labels"]
    positions = batch_positions(batch) or loss_positions(labels)
    out = model(batch["input_ids"], labels, temperature=temperature, return_entropy=return_entropy,
                positions=positions)
    # the label a hidden state at flat index i predicts sits at flat index i + 1
    label_index = positions["gather_index"] + 1

    def dense(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(labels.numel()).index_copy(0, label_index, values).view(labels.shape)

    if return_entropy:
        return dense(out[0]), dense(out[2])
    return dense(out[0])
