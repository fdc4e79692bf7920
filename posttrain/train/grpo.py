"""``posttrain grpo``: value-free online RL with verifiable rewards on the open loop.

setup → read RL prompts → policy (``build_policy``; ``model.lora`` applies as for SFT) → reward
function (``posttrain.rl.rewards``) → ``GRPOSource`` (samples each step's batch from the current
weights, ``posttrain.rl.source``) + the token-level policy loss (``posttrain.algorithms.rl``) → the
shared loop (health guard, checkpoints with the sampler's state, preemption) → held-out reward → export.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from posttrain import dist
from posttrain.algorithms.rl import AGGREGATIONS, rl_token_loss
from posttrain.config.rl import GRPORecipe
from posttrain.data.errors import DataError
from posttrain.data.io import read_records
from posttrain.data.records import RLPrompt
from posttrain.generate.engine import SamplingParams
from posttrain.models.logprobs import IGNORE_INDEX, TokenLogprobModel
from posttrain.models.moe import num_experts, routers
from posttrain.models.routing_replay import RoutingReplay, check_replayable
from posttrain.rl.engines import RolloutEngine, RolloutFn, rollout_engine
from posttrain.rl.offpolicy import trainer_logprobs_fn
from posttrain.rl.prompts import PromptSampler
from posttrain.rl.rewards import RewardFunction
from posttrain.rl.rollout import completion_logprobs, full_weights
from posttrain.rl.source import GRPOSource
from posttrain.store.run_store import working_dir
from posttrain.train.loop import train
from posttrain.train.parallelize import parallelize, uses_fsdp
from posttrain.train.precision import autocast
from posttrain.train.runner import (
    build_policy,
    export_final,
    finish,
    loop_settings,
    peek_data,
    say,
    start_run,
)
from posttrain.train.sft import curriculum_items
from posttrain.train.stream import Difficulty


def read_prompts(config: GRPORecipe, path: str, suffix: str) -> list[RLPrompt]:
    quarantine = config.data.quarantine_path or f"{working_dir(config.output_dir, config.store.local_dir)}/quarantine{suffix}.jsonl"
    records, report = read_records(path, kind="rl", fmt=config.data.format, on_error=config.data.on_error,
                                   quarantine_path=quarantine, split_across_ranks=True,
                                   max_record_bytes=config.data.max_record_bytes)
    say(report.summary())
    report.check_usable("prompt set" if suffix == "" else "eval prompt set")
    return records  # type: ignore[return-value]


def fitting_prompts(config: GRPORecipe, prompts: list[RLPrompt], tokenizer, path: str) -> list[RLPrompt]:
    """The prompts that leave room for ``rl.max_new_tokens`` in ``train.max_length``; the rest are dropped
    and counted (a completion must never be cut to fit, or its tokens would not be the sampled ones)."""
    from posttrain.data.chat import encode_prompt

    room = config.train.max_length - config.rl.max_new_tokens
    kept = [p for p in prompts if len(encode_prompt(tokenizer, p.prompt)) <= room]
    if not kept:
        raise DataError(path, None, "prompt", f"no prompt fits in train.max_length={config.train.max_length} minus "
                        f"rl.max_new_tokens={config.rl.max_new_tokens} = {room} tokens; raise train.max_length")
    if len(kept) < len(prompts):
        say(f"{path}: dropped {len(prompts) - len(kept)} prompt(s) longer than {room} tokens (train.max_length - "
            "rl.max_new_tokens)")
    return kept


def total_steps(config: GRPORecipe, prompts: int) -> int:
    train = config.train
    if train.max_steps is not None:
        return train.max_steps
    return max(1, math.floor((train.epochs or 1.0) * prompts / train.global_batch))


def grpo_loss(config: GRPORecipe, replay: RoutingReplay | None = None):
    """The loss the loop calls per micro-batch: the aggregation's numerator (the loop divides by the
    update's global denominator, from ``GRPOSource``) and per-token means of the RL statistics. ``replay``
    (``rl.routing_replay``): the forward routes every token to the experts the sampler chose, and
    ``routing_agreement`` logs the share of (token, MoE layer) pairs whose own top-K was the same."""
    rl = config.rl
    aggregation = AGGREGATIONS.get(rl.aggregation)

    def loss(model: torch.nn.Module, batch: dict[str, Any]):
        if replay is not None:  # stays loaded for the backward's activation-checkpointing recompute
            replay.load(batch.get("routed_experts"))
        # [B, L] in the layout of the batch's old_logprobs (posttrain.rl.rollout): the ratio is position-wise.
        logprobs, entropy = completion_logprobs(model, batch, rl.temperature, return_entropy=True)
        keep = batch["labels"] != IGNORE_INDEX
        per_token, stats = rl_token_loss(
            logprobs, batch["old_logprobs"], batch["advantages"], keep,
            policy_loss=rl.policy_loss, clip_low=rl.clip_low, clip_high=rl.clip_high, kl_beta=rl.kl_beta,
            ref_logprobs=batch.get("ref_logprobs"), kl_estimator=rl.kl_estimator,
            behaviour_logprobs=batch.get("behaviour_logprobs"), is_correction=rl.is_correction, is_cap=rl.is_cap,
            is_band=rl.is_band, is_level=rl.is_level,
        )
        numerator = aggregation.numerator(per_token, keep, max_new_tokens=rl.max_new_tokens)
        # The loop divides metric sums by the update's normaliser; metric_scale (normaliser / the update's
        # loss tokens) turns these token sums into per-token means in the log, whatever the aggregation.
        scale = batch["metric_scale"]
        low, high = stats["clip_low_tokens"], stats["clip_high_tokens"]
        metrics = {"clip_fraction": (low + high) * scale, "clip_fraction/low": low * scale,
                   "clip_fraction/high": high * scale, "entropy": entropy.detach().sum() * scale,
                   # a product, not mask indexing: indexing would wait for the device to count the kept tokens
                   "log_ratio": ((logprobs.detach() - batch["old_logprobs"]) * keep).sum() * scale}
        if "kl_sum" in stats:
            metrics["kl"] = stats["kl_sum"] * scale
        if replay is not None:
            metrics["routing_agreement"] = (replay.agreement(keep.shape) * keep).sum() * scale
        if "is_weight_sum" in stats:  # rl.is_correction: the mean weight and the shares it capped or masked
            metrics.update({"is_weight": stats["is_weight_sum"] * scale,
                            "is_truncated_share": stats["is_truncated_tokens"] * scale,
                            "is_masked_share": stats["is_masked_tokens"] * scale})
        return numerator, metrics

    return loss


def load_reference(config: GRPORecipe, root: torch.nn.Module):
    """The reference for the KL term (``rl.kl_beta > 0`` only): with ``model.lora`` and the base as the
    reference, the policy itself with its adapters disabled (no second model); else a frozen copy of
    ``rl.reference_model`` sharded like the policy."""
    from posttrain.models.attention import attention_for
    from posttrain.models.load import load_model
    from posttrain.models.lora import adapter_disabled

    rl, train_cfg = config.rl, config.train
    path = rl.reference_model or config.model.path
    sharded = uses_fsdp(train_cfg.fsdp)
    if config.model.lora is not None and path == config.model.path:
        reference, context = root, adapter_disabled
        say(f"reference for the KL term (β={rl.kl_beta}): the policy with its LoRA adapters disabled")
    else:
        attention = attention_for(config.model, train_cfg.precision)
        reference = TokenLogprobModel(load_model(path, config.model.dtype, attention,
                                                 config.model.trust_remote_code), train_cfg.loss_chunk_size)
        reference.requires_grad_(False)
        parallelize(reference, reference.lm, fsdp=train_cfg.fsdp, precision=train_cfg.precision,
                    cpu_offload=train_cfg.cpu_offload, activation_checkpointing="none", ac_every=1)
        reference.eval()
        context = contextlib.nullcontext
        say(f"reference model for the KL term (β={rl.kl_beta}): {path}")

    def logprobs(batch: dict[str, Any]) -> torch.Tensor:
        with torch.no_grad(), autocast(train_cfg.precision, sharded), context(reference):
            return completion_logprobs(reference, batch, rl.temperature).float()

    return logprobs


def reward_evaluator(prompts: list[RLPrompt], root: torch.nn.Module, lm: torch.nn.Module, tokenizer,
                     params: SamplingParams, rewards, batch_size: int, episodes=None):
    """``evaluate(model) -> {"reward", "pass@1", "prompts"}`` over held-out prompts: one greedy completion each,
    scored by the run's reward, split over ranks (``sharded_sums``; under FSDP the weights are gathered
    once per pass, ``posttrain.rl.rollout.full_weights``). ``episodes`` (``env:``, an ``EpisodeRollouts``): one
    greedy episode each with the environment and its tool instead, its final answer scored, a failed episode 0
    (``episode_reward``), plus ``tool_call_rate``, ``turns_mean``, ``tool_errors`` and ``failed_share``."""
    from posttrain.generate.engine import HFBackend
    from posttrain.rl.multiturn import episode_reward
    from posttrain.train.evaluation import sharded_sums

    per_rank = math.ceil(len(prompts) / dist.world_size())

    def measure(model: torch.nn.Module, chunk: list[RLPrompt]) -> torch.Tensor:  # noqa: ARG001 - root is the model
        if episodes is not None:
            rollouts = episodes.evaluate(chunk)
            texts = [r.text for r in rollouts]
        else:
            with full_weights(root):
                completions = HFBackend(lm, tokenizer).generate([p.prompt for p in chunk], params,
                                                                batch_size=batch_size, progress=False)
            texts = [group[0].text for group in completions]
        scored = rewards.score(chunk, texts)
        values, passed, extra = list(scored.rewards), list(scored.passed), [0.0] * 4
        if episodes is not None:
            counters: Counter = Counter()
            pairs = [episode_reward(r, value, ok, counters)
                     for r, value, ok in zip(rollouts, values, passed, strict=True)]
            values, passed = [value for value, _ in pairs], [ok for _, ok in pairs]
            infos = [r.episode or {} for r in rollouts]
            extra = [float(sum(i.get("tool_calls", 0) > 0 for i in infos)), float(sum(i.get("turns", 0) for i in infos)),
                     float(sum(i.get("tool_errors", 0) for i in infos)), float(sum(bool(i.get("failure")) for i in infos))]
        verdicts = [p for p in passed if p is not None]
        return torch.tensor([sum(values), float(sum(verdicts)), float(len(verdicts)), float(len(chunk)), *extra],
                            dtype=torch.float64)

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        total = sharded_sums(model, prompts, per_rank, measure)
        figures = {"reward": float(total[0] / total[3]), "prompts": int(total[3])}
        if total[2] > 0:
            figures["pass@1"] = float(total[1] / total[2])
        if episodes is not None:
            figures.update({"tool_call_rate": float(total[4] / total[3]), "turns_mean": float(total[5] / total[3]),
                            "tool_errors": float(total[6]), "failed_share": float(total[7] / total[3])})
        return figures

    return evaluate


@dataclass
class GRPOParts:
    """What ``run_grpo`` trains with; ``build_grpo`` makes it (tests drive the source and loss directly)."""

    root: torch.nn.Module
    lm: torch.nn.Module
    tokenizer: Any
    source: GRPOSource
    eval_prompts: list[RLPrompt]
    engine: RolloutEngine | None = None  # rollout.engine; run_grpo closes it
    replay: RoutingReplay | None = None  # rl.routing_replay: the policy's router hooks
    episodes: Any = None  # env: the EpisodeRollouts, which also evaluates data.eval as episodes


def build_grpo(config: GRPORecipe, rewards: RewardFunction) -> GRPOParts:
    """Policy, prompts (those that fit), prompt sampler, rollout function, optional reference, the source."""
    root, lm, tokenizer = build_policy(config, lambda lm: TokenLogprobModel(lm, config.train.loss_chunk_size))
    prompts = fitting_prompts(config, read_prompts(config, config.data.train, ""), tokenizer, config.data.train)
    rewards.check_prompts(prompts)
    items = curriculum_items(config, [Difficulty(p.tier, p.difficulty) for p in prompts])
    steps = total_steps(config, len(prompts))
    rl = config.rl
    sampler = PromptSampler(
        items, config.data.curriculum, config.train.seed, shuffle=config.data.shuffle,
        competence_start=config.data.competence_start,
        competence_steps=config.data.competence_steps or max(1, steps // 2),
        pass_rate_low=rl.pass_rate_low, pass_rate_high=rl.pass_rate_high, min_tries=rl.pass_rate_min_tries,
    )
    replay = routing_replay(config, lm) if rl.routing_replay else None
    params = SamplingParams(n=rl.group_size, temperature=rl.temperature, max_new_tokens=rl.max_new_tokens,
                            logprobs=True, routed_experts=rl.routing_replay)

    # rollout.engine (hf | vllm) is chosen here and nowhere else; the source and the loop see only Rollouts.
    engine = rollout_engine(config, root, lm, tokenizer)
    rollouts, episodes = RolloutFn(engine, params), None
    if config.env is not None:  # multi-turn episodes with the sandboxed tool (posttrain.rl.multiturn)
        from posttrain.rl.multiturn import EngineEpisodes, EpisodeRollouts

        rollouts = episodes = EpisodeRollouts(root, lm, tokenizer, config.env, params, rl.rollout_batch_size,
                                              config.train.max_length)
        if config.rollout.engine == "vllm":  # the engine samples the episodes; data.eval stays in process
            rollouts = EngineEpisodes(engine, episodes)
        say(f"episodes: environment {config.env.name}, {config.env.tool_format} tool calls, at most "
            f"{config.env.max_turns} turns of {config.env.max_turn_tokens} tokens, {rl.max_new_tokens} tokens in all")
    eval_prompts = (fitting_prompts(config, read_prompts(config, config.data.eval, "-eval"), tokenizer,
                                    config.data.eval) if config.data.eval else [])
    reference = load_reference(config, root) if rl.kl_beta > 0 else None
    source = GRPOSource(config, prompts, sampler, rollouts, rewards, steps, tokenizer.pad_token_id, reference,
                        trainer_logprobs=trainer_logprobs_fn(config, root, lm, tokenizer.pad_token_id, replay)
                        if rl.measure_mismatch else None)
    say(f"{len(prompts)} prompts; {steps} steps of {source.prompts_per_step} prompts × {rl.group_size} completions "
        f"({source.geometry.world} rank(s) × {source.geometry.grad_accum} micro-batch(es) of "
        f"{source.geometry.micro_batch}); {rl.advantage} advantages, {rl.policy_loss} loss, {rl.aggregation}, "
        f"β={rl.kl_beta}")
    return GRPOParts(root, lm, tokenizer, source, eval_prompts, engine, replay, episodes)


def check_grpo_start(config: GRPORecipe) -> None:
    """``start_run``'s checks, before any run state is written: the prompts (``peek_data``), and ``rl.routing_replay``
    against ``model.path``'s config (no weights): a dense model, or an MoE architecture without a replay gate, is
    ``MoeConfigError``."""
    peek_data(config, "rl", ("prompt set", "eval prompt set"))
    if not config.rl.routing_replay:
        return
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(config.model.path, trust_remote_code=config.model.trust_remote_code)
    check_replayable(hf.model_type, num_experts(hf), config.model.path)


def routing_replay(config: GRPORecipe, lm: torch.nn.Module) -> RoutingReplay:
    """Replay hooks on the loaded policy's routers (docs/moe.md, "RL: routing replay")."""
    check_replayable(lm.config.model_type, num_experts(lm.config), config.model.path)
    say(f"routing replay: the experts chosen at sampling time are forced in the training forward "
        f"({len(routers(lm))} MoE layers)")
    return RoutingReplay(lm, lm.config.model_type)


def run_grpo(config: GRPORecipe) -> int:
    run = start_run(config, check_data=check_grpo_start)
    try:
        if run.finished:
            return 0
        rl = config.rl
        with RewardFunction(config.reward) as rewards:
            parts = build_grpo(config, rewards)
            settings = loop_settings(run, parts.lm)
            settings.health.watch_loss = False  # see HealthGuard.watch_loss: RL watches the gradient norm
            if parts.eval_prompts:
                greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=rl.max_new_tokens)
                settings.evaluate = reward_evaluator(parts.eval_prompts, parts.root, parts.lm, parts.tokenizer, greedy,
                                                     rewards, rl.rollout_batch_size, parts.episodes)
            try:
                code = train(parts.root, parts.source, grpo_loss(config, parts.replay), settings)
            finally:
                if parts.engine is not None:  # a vLLM engine posttrain started stops here, before the export
                    parts.engine.close()
        if code == 0:
            finish("grpo", run, settings, export_final(run, parts.root, parts.lm, parts.tokenizer))
        return code
    finally:
        dist.destroy()
