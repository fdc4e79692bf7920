"""What off-policy RL needs besides the math: the trainer's log-probs of sampled tokens, and rollouts as JSON.

**The trainer's view of a rollout** (``trainer_logprobs``). Every sampled token carries the sampler's
log-prob (the behaviour policy ``μ``, ``Rollout.logprobs``). Right after sampling, with the *same*
weights, the trainer's own forward (``posttrain.models.logprobs``, the training numerics: precision,
chunked head, temperature, right padding) scores the same tokens, ``Rollout.train_logprobs`` =
``log π_old``. Their gap is the training–inference mismatch the step logs (``rollout/logprob_abs_diff``)
and ``rl.is_correction`` corrects (``posttrain.algorithms.rl_corrections``). Doing it at sampling time,
not at training time, is what keeps the mismatch apart from the policy lag when ``rl.max_staleness > 0``:
by the time a stale rollout is trained the sampling weights are gone. It costs one forward without
gradient over the completions that will be trained (about a third of their forward and backward; the
source skips groups without signal when ``rl.skip_zero_advantage`` leaves them out of training), and
``rl.measure_mismatch=false`` turns it off when no correction needs it. Under
FSDP2 the weights are gathered once for it (``full_weights``), a collective: every rank calls it, with
its own rollouts (possibly none). Evaluation mode, as sampling, so no dropout draws from any generator.

**Rollouts in a checkpoint** (``encode_rollout`` / ``decode_rollout``). With ``rl.max_staleness = k`` the
step source holds the rollouts of the next ``k`` steps at every checkpoint; they go into ``trainer.json``
(JSON, never pickle: ``posttrain.train.checkpoint_safety``). Token ids and log-probs are little-endian
``int32`` / ``float64`` arrays in base64 — about 11 characters per id and 11 per log-prob, and exact:
every float comes back bit for bit, which a bit-identical resume needs. Decoding checks types and
lengths, since a checkpoint is data from whoever can write the run directory. With ``rl.routing_replay`` a
rollout also carries its routed experts, ``{"shape": [tokens, layers, K], "ids": <int16 base64>}``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from posttrain import dist
from posttrain.models.logprobs import loss_positions, model_token_logprobs
from posttrain.models.routing_replay import UNROUTED, RoutingReplay
from posttrain.rl.rollout import Rollout, completion_logprobs, full_weights, rollout_batch
from posttrain.train.precision import autocast

__all__ = ["decode_rollout", "encode_rollout", "token_layout", "trainer_logprobs", "trainer_logprobs_fn"]


def trainer_logprobs(root: torch.nn.Module, lm: torch.nn.Module, rollouts: Sequence[Rollout], *, pad_id: int,
                     temperature: float, batch_size: int, chunk_size: int, precision: str, sharded: bool,
                     replay: RoutingReplay | None = None, lockstep: bool = False) -> None:
    """Set ``rollout.train_logprobs`` for every rollout: the training forward's float32 log-probs of its
    completion tokens with the current weights, in micro-batches of ``batch_size``. ``lm`` is ``root``'s HF
    model; the forward is the one ``TokenLogprobModel`` runs (same chunk size), called on ``lm`` inside
    ``full_weights(root)`` so that no FSDP collective runs per micro-batch. Collective under FSDP. ``replay``
    (``rl.routing_replay``): the forward routes each token to the experts the sampler chose, as training does.
    ``lockstep`` (expert parallelism: every MoE forward is an all-to-all over the ranks): every rank runs the
    largest rank's number of micro-batches (an all-reduce of the count); a rank with fewer runs a two-token dummy
    forward for each missing one and drops its result."""
    was_training = root.training
    root.eval()

    def forward(input_ids, labels, *, temperature, return_entropy, positions):
        return model_token_logprobs(lm, input_ids, labels, chunk_size=chunk_size, temperature=temperature,
                                    return_entropy=return_entropy, positions=positions)

    device = dist.device()
    chunks = -(-len(rollouts) // batch_size)
    if lockstep and dist.world_size() > 1:
        count = torch.tensor([chunks], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        missing = int(count) - chunks
    else:
        missing = 0
    try:
        with torch.no_grad(), full_weights(root), autocast(precision, sharded):
            for _ in range(missing):  # the other ranks' extra micro-batches: the same collectives, no result
                lm(input_ids=torch.full((1, 2), pad_id, dtype=torch.long, device=device))
            for start in range(0, len(rollouts), batch_size):
                chunk = list(rollouts[start : start + batch_size])
                batch = rollout_batch(chunk, pad_id, temperature)
                batch.update(loss_positions(batch["labels"]))
                batch = {key: value.to(device) for key, value in batch.items()}
                routed = replay.forced(batch.get("routed_experts")) if replay is not None else contextlib.nullcontext()
                with routed:
                    values = completion_logprobs(forward, batch, temperature).float().cpu()
                mask = batch["completion_mask"].cpu()
                for rollout, row, keep in zip(chunk, values, mask, strict=True):
                    rollout.train_logprobs = _spread(rollout, row[keep].tolist())
    finally:
        root.train(was_training)


def _spread(rollout: Rollout, trained: list[float]) -> list[float]:
    """One value per completion token from the values at its trained positions: an episode's environment tokens
    (``loss_mask`` 0) get 0.0, as their sampling-time placeholders in ``logprobs`` do."""
    if rollout.loss_mask is None:
        return trained
    values = iter(trained)
    return [next(values) if keep else 0.0 for keep in rollout.loss_mask]


def trainer_logprobs_fn(config, root: torch.nn.Module, lm: torch.nn.Module, pad_id: int,
                        replay: RoutingReplay | None = None) -> Callable[[Sequence[Rollout]], None]:
    """``trainer_logprobs`` bound to a GRPO recipe's settings (``train.batch_size`` completions per forward)."""
    from posttrain.train.parallelize import uses_fsdp

    train = config.train

    def score(rollouts: Sequence[Rollout]) -> None:
        trainer_logprobs(root, lm, rollouts, pad_id=pad_id, temperature=config.rl.temperature,
                         batch_size=train.batch_size, chunk_size=train.loss_chunk_size, precision=train.precision,
                         sharded=uses_fsdp(train.fsdp), replay=replay, lockstep=config.parallel.expert > 1)

    return score


def token_layout(rollouts: Sequence[Rollout], values: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """``[B, width]`` float32 with ``values[b]`` at rollout ``b``'s completion positions and 0 elsewhere: the
    layout of ``rollout_batch``'s ``old_logprobs`` (right padding), for another per-token quantity."""
    rows = []
    for rollout, row in zip(rollouts, values, strict=True):
        if len(row) != len(rollout.completion_ids):
            raise ValueError(f"rollout (prompt {rollout.prompt_key}, sample {rollout.sample_index}) has "
                             f"{len(rollout.completion_ids)} completion tokens but {len(row)} values")
        pad = width - len(rollout.prompt_ids) - len(row)
        rows.append([0.0] * len(rollout.prompt_ids) + list(row) + [0.0] * pad)
    return torch.tensor(rows, dtype=torch.float32)


# --- rollouts as JSON -------------------------------------------------------------------------------------


def _pack(values: Sequence[Any], dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode("ascii")


def _unpack(text: Any, dtype: str, what: str) -> list:
    if not isinstance(text, str):
        raise ValueError(f"queued rollout: {what} is {type(text).__name__}, not a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"queued rollout: {what} is not base64 ({exc})") from None
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise ValueError(f"queued rollout: {what} holds {len(raw)} bytes, not a whole number of {dtype} values")
    return np.frombuffer(raw, dtype=dtype).tolist()


def encode_rollout(rollout: Rollout) -> dict[str, Any]:
    """``rollout`` as a JSON-serialisable dict; ``decode_rollout`` gives back an equal ``Rollout``, floats exact."""
    out: dict[str, Any] = {
        "key": rollout.prompt_key, "sample": rollout.sample_index, "version": rollout.version,
        "prompt_ids": _pack(rollout.prompt_ids, "<i4"), "completion_ids": _pack(rollout.completion_ids, "<i4"),
        "logprobs": _pack(rollout.logprobs, "<f8"), "finish": rollout.finish_reason,
        "truncated": rollout.truncated, "text": rollout.text, "temperature": rollout.temperature,
    }
    if rollout.train_logprobs is not None:
        out["train_logprobs"] = _pack(rollout.train_logprobs, "<f8")
    if rollout.routed_experts is not None:  # rl.routing_replay: [tokens, MoE layers, K] int16
        out["routed_experts"] = {"shape": list(rollout.routed_experts.shape),
                                 "ids": _pack(rollout.routed_experts.reshape(-1), "<i2")}
    if rollout.loss_mask is not None:
        out["loss_mask"] = _pack(rollout.loss_mask, "<u1")
    if rollout.episode is not None:
        out["episode"] = dict(rollout.episode)
    return out


def decode_rollout(data: Any) -> Rollout:
    """The ``Rollout`` ``encode_rollout`` wrote; ``ValueError`` naming the field for anything malformed."""
    if not isinstance(data, dict):
        raise ValueError(f"queued rollout is {type(data).__name__}, not an object")
    checks = {"key": int, "sample": int, "version": int, "finish": str, "truncated": bool, "text": str,
              "temperature": (int, float)}
    for field, kind in checks.items():
        if not isinstance(data.get(field), kind) or (kind is int and isinstance(data.get(field), bool)):
            raise ValueError(f"queued rollout: {field} is {data.get(field)!r}")
    completion = _unpack(data.get("completion_ids"), "<i4", "completion_ids")
    logprobs = _unpack(data.get("logprobs"), "<f8", "logprobs")
    train = _unpack(data["train_logprobs"], "<f8", "train_logprobs") if "train_logprobs" in data else None
    if len(logprobs) != len(completion) or (train is not None and len(train) != len(completion)):
        raise ValueError("queued rollout: one log-prob per completion token expected")
    loss_mask = _unpack(data["loss_mask"], "<u1", "loss_mask") if "loss_mask" in data else None
    if loss_mask is not None and (len(loss_mask) != len(completion) or any(v > 1 for v in loss_mask)):
        raise ValueError("queued rollout: loss_mask needs one 0/1 entry per completion token")
    routed = _routed_experts(data, len(completion)) if "routed_experts" in data else None
    episode = data.get("episode")
    if episode is not None and not (isinstance(episode, dict) and all(
            isinstance(k, str) and (v is None or isinstance(v, (int, float, str))) for k, v in episode.items())):
        raise ValueError("queued rollout: episode must be an object of numbers and strings")
    return Rollout(prompt_key=data["key"], sample_index=data["sample"],
                   prompt_ids=_unpack(data.get("prompt_ids"), "<i4", "prompt_ids"), completion_ids=completion,
                   logprobs=logprobs, finish_reason=data["finish"], truncated=data["truncated"], text=data["text"],
                   temperature=float(data["temperature"]), version=data["version"], train_logprobs=train,
                   loss_mask=loss_mask, episode=None if episode is None else dict(episode), routed_experts=routed)


def _routed_experts(data: dict[str, Any], completion_tokens: int) -> np.ndarray:
    """``encode_rollout``'s ``routed_experts``: ``int16 [prompt + completion tokens, layers, K]``, ids >= -1."""
    field = data["routed_experts"]
    if not isinstance(field, dict) or set(field) != {"shape", "ids"}:
        raise ValueError("queued rollout: routed_experts must be an object with shape and ids")
    shape = field["shape"]
    if not (isinstance(shape, list) and len(shape) == 3
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):
        raise ValueError(f"queued rollout: routed_experts shape is {shape!r}, not [tokens, layers, K]")
    tokens = len(_unpack(data.get("prompt_ids"), "<i4", "prompt_ids")) + completion_tokens
    if shape[0] != tokens:
        raise ValueError(f"queued rollout: routed_experts has {shape[0]} rows for {tokens} tokens")
    _unpack(field["ids"], "<i2", "routed_experts")  # type and length checks only
    ids = np.frombuffer(base64.b64decode(field["ids"]), dtype="<i2").astype(np.int16)
    if ids.size != shape[0] * shape[1] * shape[2]:
        raise ValueError(f"queued rollout: routed_experts holds {ids.size} ids, not {shape[0]}x{shape[1]}x{shape[2]}")
    if ids.size and int(ids.min()) < UNROUTED:
        raise ValueError(f"queued rollout: routed_experts has an expert id below {UNROUTED}")
    return ids.reshape(shape)
