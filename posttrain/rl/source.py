"""The GRPO step source: each optimizer step's batch is sampled from the policy being trained.

``next_step(step, model)``:
1. draw ``train.global_batch_size`` prompts (``PromptSampler``: the same draw on every rank);
2. each rank samples ``rl.group_size`` completions for its share of the prompts from the *current*
   weights, recording each token's log-probability under the sampling policy (the ratio's old policy);
3. each rank scores its completions (``reward``), adds the overlong shaping, and every rank receives
   every group (one ``all_gather_object`` of token ids, log-probs and rewards — small next to a step);
4. with ``rl.dynamic_sampling``, groups whose rewards are all equal are dropped and more prompts are
   drawn (at most ``rl.max_sampling_rounds`` draws; a batch still short is filled with zero-signal
   groups and counted);
5. advantages over the global batch (``rl.advantage``), then the batch is cut the way
   ``BatchGeometry`` cuts a stream — rank ``r``'s micro-batch ``a`` holds completions
   ``(a·W + r)·B …`` of the global batch — so the step does not depend on the number of ranks; with
   ``rl.updates_per_rollout = U`` the global batch is ``U`` consecutive mini-batches, one update each,
   each normalised by its own global token / sequence count (``rl.aggregation``).

Randomness: completion ``s`` of the prompt at global draw position ``j`` of step ``t`` (positions
count on through the rounds of dynamic sampling) is sampled from a generator seeded by
``(train.seed, t, j, s)``, whichever rank samples it. So a
resumed run (same weights, same sampler state) samples the same completions, and 1 and 2 ranks sample
the same batch.

Bounded staleness (``rl.max_staleness = k``): the rollouts of step ``t`` are sampled — prompts drawn,
completions sampled and scored, the trainer's log-probs recomputed (``posttrain.rl.offpolicy``) — at the
start of step ``t − k``, with that step's weights (its *version*), and wait in a queue until step ``t``
trains on them; the first ``k`` steps train on rollouts of version 0 (warm-up). ``k = 0`` is the
synchronous loop, the same code path. The queue is part of ``state()`` (the next ``k`` steps' rollouts,
encoded compactly), so a resumed run trains on exactly the rollouts the uninterrupted run would have. A
step the loop skips drops its queued rollouts; the steps after it are then sampled one version later.

Overlap (``rollout.overlap``, an engine in its own process — vLLM — and ``k >= 1``): step ``t``'s source
syncs the engine to version ``t`` and *submits* the first sampling round of step ``t + k`` before returning,
so the engine samples while step ``t`` trains; the loop's ``before_update`` hook (after the first backward,
before the optimizer step: the weights are still version ``t``) collects them and does the rest — further
dynamic-sampling rounds, rewards, the trainer's log-probs, the gather. Same draws, seeds and weights as
without overlap, in the same order, so the same rollouts: only the wall time changes. A step that never
reaches its update (an exception) leaves them uncollected: ``end_step`` drops them and the next step samples
that step again, synchronously, with its own weights.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain import dist
from posttrain.algorithms.rl import ADVANTAGES, AGGREGATIONS, mismatch_figures, overlong_penalty
from posttrain.data.records import RLPrompt
from posttrain.rl.engines import Ready
from posttrain.rl.multiturn import episode_metrics, episode_reward
from posttrain.rl.offpolicy import decode_rollout, encode_rollout, token_layout
from posttrain.rl.prompts import PromptSampler
from posttrain.rl.rollout import Rollout, rollout_batch, trained_count, trained_values
from posttrain.train.source import BatchGeometry, BatchSizeError, StepBatch


@dataclass
class Sample:
    """One scored completion (its rollout, reward and verdict), as every rank sees it after the gather."""

    rollout: Rollout
    reward: float
    passed: bool | None

    @property
    def prompt_ids(self) -> list[int]:
        return self.rollout.prompt_ids

    @property
    def completion_ids(self) -> list[int]:
        return self.rollout.completion_ids

    @property
    def logprobs(self) -> list[float]:
        return self.rollout.logprobs

    @property
    def truncated(self) -> bool:
        return self.rollout.truncated


@dataclass
class Group:
    position: int  # global draw position within the step (round-major): the sampling order
    prompt_index: int
    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def has_signal(self) -> bool:
        return max(self.rewards) > min(self.rewards)


@dataclass
class Draw:
    """One step's groups being drawn with the weights of ``version``: rounds of dynamic sampling so far, and
    the round in flight (``pending``: this rank's ``(position, prompt index)`` share, what the engine returned
    or will return, and the round's size)."""

    step: int
    version: int
    kept: list[Group] = field(default_factory=list)
    spare: list[Group] = field(default_factory=list)
    drawn: list[Group] = field(default_factory=list)
    position: int = 0
    rounds: int = 0
    pending: tuple[list[tuple[int, int]], Any, int] | None = None


@dataclass
class Queued:
    """The rollouts of one future step, sampled ahead with the weights of step ``version``: the kept groups,
    what the draw measured (``metrics``) and the pass/try counts the prompt sampler learns on acceptance."""

    step: int
    version: int
    groups: list[Group]
    metrics: dict[str, Any]
    outcomes: dict[int, tuple[int, int]]

    def encode(self) -> dict[str, Any]:
        groups = [{"position": g.position, "prompt": g.prompt_index,
                   "samples": [{"reward": s.reward, "passed": s.passed, "rollout": encode_rollout(s.rollout)}
                               for s in g.samples]} for g in self.groups]
        return {"step": self.step, "version": self.version, "metrics": self.metrics, "groups": groups,
                "outcomes": [[index, passed, tried] for index, (passed, tried) in sorted(self.outcomes.items())]}

    @classmethod
    def decode(cls, data: dict[str, Any]) -> Queued:
        try:
            groups = [Group(int(g["position"]), int(g["prompt"]),
                            [Sample(decode_rollout(s["rollout"]), float(s["reward"]),
                                    None if s["passed"] is None else bool(s["passed"])) for s in g["samples"]])
                      for g in data["groups"]]
            outcomes = {int(i): (int(p), int(t)) for i, p, t in data["outcomes"]}
            return cls(int(data["step"]), int(data["version"]), groups, dict(data["metrics"]), outcomes)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the checkpoint's queued rollouts are malformed: {exc}") from None


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of one step; with a prompt's draw position as its key (``prompt_keys``) the engine
    gives each completion its own generator. A fixed mixing, not Python's ``hash``, which is not promised
    to stay the same across Python versions."""
    return (seed * 1_000_003 + step + 1) % (2**31 - 1)


class GRPOSource:
    """See the module docstring. ``sampler`` draws prompts, ``rollouts`` samples, ``rewards`` scores."""

    name = "grpo"

    def __init__(self, config, prompts: list[RLPrompt], sampler: PromptSampler, rollouts, rewards, total_steps: int,
                 pad_id: int, reference=None, trainer_logprobs=None):
        self.config, self.rl, self.prompts, self.sampler = config, config.rl, prompts, sampler
        self.rollouts, self.rewards, self.reference, self.pad_id = rollouts, rewards, reference, pad_id
        self._total = total_steps
        group = self.rl.group_size
        self.prompts_per_step = config.train.global_batch
        self.geometry = BatchGeometry.derive(self.prompts_per_step * group, config.train.batch_size, dist.world_size())
        if self.geometry.grad_accum % self.rl.updates_per_rollout:
            raise BatchSizeError(
                f"each rank's {self.geometry.grad_accum} micro-batch(es) per step do not split into "
                f"rl.updates_per_rollout={self.rl.updates_per_rollout} updates; lower train.batch_size or change "
                "rl.updates_per_rollout")
        self.aggregation = AGGREGATIONS.get(self.rl.aggregation)
        self.advantage = ADVANTAGES.get(self.rl.advantage)
        self.counters: Counter = Counter()
        self._pending: dict[int, tuple[int, int]] = {}
        self._log: dict[str, Any] = {}
        self._sampled_at = 0.0
        self.last_groups: list[Group] = []
        self.last_sequences: list[tuple[Sample, float]] = []
        # trainer_logprobs(rollouts): sets each rollout's train_logprobs with the sampling weights (collective)
        self.trainer_logprobs = trainer_logprobs
        if self.rl.is_correction != "none" and trainer_logprobs is None:
            raise ValueError(f"rl.is_correction={self.rl.is_correction} needs the trainer's log-probs of each rollout: "
                             "pass trainer_logprobs (posttrain.rl.offpolicy.trainer_logprobs_fn)")
        self.queue: list[Queued] = []  # rollouts sampled ahead (rl.max_staleness), in step order
        self._generated = 0  # tokens sampled for the current step's log, all ranks
        # sample the step k ahead while this one trains: an engine of its own (vLLM) and k >= 1
        self.overlap = (self.rl.max_staleness > 0 and getattr(rollouts, "overlaps", False)
                        and getattr(getattr(config, "rollout", None), "overlap", True))
        self._ahead: Draw | None = None  # the draw in flight (overlap), finished by before_update

    def total_steps(self) -> int:
        return self._total

    # ------------------------------------------------------------------ sampling

    def _start_round(self, draw: Draw, indices: list[int]) -> None:
        """Submit this rank's share of ``indices`` (round-robin) to the engine; ``_finish_round`` takes it up."""
        world, rank = dist.world_size(), dist.rank()
        mine = [(draw.position + j, index) for j, index in enumerate(indices) if j % world == rank]
        prompts, keys = [self.prompts[index] for _, index in mine], [position for position, _ in mine]
        seed = step_seed(self.config.train.seed, draw.step)
        submit = getattr(self.rollouts, "submit", None)
        if submit is not None:
            sampled = submit(prompts, keys, seed, draw.version)
        else:  # a plain function (tests, custom samplers): samples now, with the live weights
            started = time.perf_counter()
            groups = self.rollouts(prompts, keys, seed, draw.version)
            for rollout in (r for group in groups for r in group):
                rollout.version = draw.version
            sampled = Ready(groups, time.perf_counter() - started)
        draw.pending = (mine, sampled, len(indices))

    def _finish_round(self, draw: Draw) -> list[Group]:
        """Wait for the round in flight, score it, recompute the trainer's log-probs, gather every rank's groups."""
        mine, sampled, size = draw.pending
        draw.pending = None
        waited = time.perf_counter()
        groups_sampled = sampled.result()
        self._add("time/rollout_wait_s", time.perf_counter() - waited)
        self._add("time/generate_s", sampled.seconds)
        self._log.update(getattr(self.rollouts, "log", {}))  # the engine's figures (rollout/sync_s, …)
        flat_prompts = [self.prompts[index] for (_, index), group in zip(mine, groups_sampled, strict=True)
                        for _ in group]
        flat = [rollout for group in groups_sampled for rollout in group]
        started = time.perf_counter()
        scored = self.rewards.score(flat_prompts, [rollout.text for rollout in flat])
        self.counters.update({f"reward_failure/{why}": n for why, n in scored.failures.items()})
        self._add("time/reward_s", time.perf_counter() - started)
        groups, at = [], 0
        for (position, index), group in zip(mine, groups_sampled, strict=True):
            samples = []
            for rollout in group:
                reward = scored.rewards[at] - overlong_penalty(len(rollout.completion_ids), self.rl.max_new_tokens,
                                                               self.rl.overlong_buffer, self.rl.overlong_penalty)
                passed = scored.passed[at]
                if rollout.episode is not None:  # multi-turn: the environment's shaping; 0 for a failed episode
                    reward, passed = episode_reward(rollout, reward, passed, self.counters)
                samples.append(Sample(rollout, float(reward), passed))
                at += 1
            groups.append(Group(position, index, samples))
        if self.trainer_logprobs is not None:
            # With the sampling weights: the mismatch, apart from any lag. A group without signal is never
            # trained when zero advantages are skipped (rl.skip_zero_advantage), so it is not scored either.
            skip = self.rl.skip_zero_advantage and self.rl.kl_beta == 0
            started = time.perf_counter()
            self.trainer_logprobs([s.rollout for g in groups if g.has_signal or not skip for s in g.samples])
            self._add("time/recompute_s", time.perf_counter() - started)
        gathered = [g for part in dist.gather_objects(groups) for g in part]
        self._generated += sum(len(s.completion_ids) for g in gathered for s in g.samples)
        draw.position += size
        return sorted(gathered, key=lambda g: g.position)

    def _add(self, key: str, seconds: float) -> None:
        self._log[key] = self._log.get(key, 0.0) + seconds

    def _start_next_round(self, draw: Draw) -> None:
        need = self.prompts_per_step - len(draw.kept)
        self._start_round(draw, self.sampler.draw(draw.step, need))

    def _begin_draw(self, step: int, version: int) -> Draw:
        """Draw step ``step``'s first prompts and submit them (``_complete_draw`` does the rest)."""
        draw = Draw(step, version)
        self._start_next_round(draw)
        return draw

    def _complete_draw(self, draw: Draw) -> Queued:
        """Finish ``draw``: its rounds (more while dynamic sampling keeps fewer groups than a step needs, at
        most ``rl.max_sampling_rounds``), exactly ``prompts_per_step`` groups, and what the draw measured."""
        wanted = self.prompts_per_step
        rounds = self.rl.max_sampling_rounds if self.rl.dynamic_sampling else 1
        while draw.pending is not None:
            groups = self._finish_round(draw)
            draw.rounds += 1
            draw.drawn += groups
            for group in groups:
                (draw.kept if not self.rl.dynamic_sampling or group.has_signal else draw.spare).append(group)
            if draw.rounds < rounds and len(draw.kept) < wanted:
                self._start_next_round(draw)
        kept = draw.kept
        if len(kept) < wanted:
            short = wanted - len(kept)
            self.counters["dynamic_sampling_short"] += short
            kept = kept + draw.spare[:short]
        kept = kept[:wanted]
        outcomes: dict[int, tuple[int, int]] = {}
        for group in draw.drawn:
            verdicts = [s.passed for s in group.samples if s.passed is not None]
            if verdicts:
                passed, tried = outcomes.get(group.prompt_index, (0, 0))
                outcomes[group.prompt_index] = (passed + sum(verdicts), tried + len(verdicts))
        metrics = {"sampling_rounds": draw.rounds, **self._metrics(draw.drawn, kept)}
        return Queued(draw.step, draw.version, kept, metrics, outcomes)

    # ------------------------------------------------------------------ the batch

    def _metrics(self, drawn: list[Group], kept: list[Group]) -> dict[str, Any]:
        samples = [s for g in drawn for s in g.samples]
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        lengths = [len(s.completion_ids) for s in samples]
        tokens = sum(lengths)
        record: dict[str, Any] = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "completion_len_mean": tokens / len(samples),
            "completion_len_max": max(lengths),
            "truncated_share": sum(s.truncated for s in samples) / len(samples),
            "zero_signal_share": sum(not g.has_signal for g in drawn) / len(drawn),
            "generated_tokens": tokens,
            "prompts_sampled": len(drawn),
        }
        verdicts = [s.passed for s in samples if s.passed is not None]
        if verdicts:
            record["pass@1"] = sum(verdicts) / len(verdicts)
            record[f"pass@{self.rl.group_size}"] = sum(any(s.passed for s in g.samples) for g in drawn) / len(drawn)
            by_tier: dict[int, list[bool]] = {}
            for g in drawn:
                tier = self.prompts[g.prompt_index].tier
                if tier is not None:
                    by_tier.setdefault(tier, []).extend(s.passed for s in g.samples if s.passed is not None)
            for tier, passed in sorted(by_tier.items()):
                if passed:
                    record[f"pass@1/tier_{tier}"] = sum(passed) / len(passed)
        record["kept_groups_with_signal"] = sum(g.has_signal for g in kept)
        record.update(episode_metrics([s.rollout for s in samples]))  # multi-turn only: turns, tool calls, …
        return record

    def _advantages(self, kept: list[Group]) -> torch.Tensor:
        rewards = torch.tensor([s.reward for g in kept for s in g.samples], dtype=torch.float32)
        group_ids = torch.tensor([i for i, g in enumerate(kept) for _ in g.samples], dtype=torch.long)
        return self.advantage(rewards, group_ids, self.rl.advantage_eps)

    def _rollouts_for(self, step: int) -> Queued:
        """Step ``step``'s queued rollouts, after sampling those of steps up to ``step + k`` that are missing
        (one step's, after warm-up) with the current weights: step ``step``'s, version ``step``. With overlap,
        step ``step + k``'s draw is only started (``self._ahead``; ``collect_ahead`` finishes it)."""
        self.queue = [queued for queued in self.queue if queued.step >= step]
        have = {queued.step for queued in self.queue}
        last = min(step + self.rl.max_staleness, self._total - 1)  # nothing is sampled for steps the run never has
        for target in range(step, last + 1):
            if target in have:
                continue
            draw = self._begin_draw(target, step)
            if self.overlap and target == last:
                self._ahead = draw
            else:
                self.queue.append(self._complete_draw(draw))
        self.queue.sort(key=lambda queued: queued.step)
        return self.queue.pop(0)

    def collect_ahead(self) -> None:
        """Finish the draw sampled in the background while the step trained (``StepBatch.before_update``: every
        rank, before the first optimizer step, while the weights are still the draw's version)."""
        draw, self._ahead = self._ahead, None
        if draw is None:
            return
        self.queue.append(self._complete_draw(draw))
        self.queue.sort(key=lambda queued: queued.step)
        self._throughput()

    def _throughput(self) -> None:
        if self._log.get("time/generate_s", 0.0) > 0:  # what this step sampled (the next steps', with k > 0)
            self._log["generated_tokens_per_s"] = self._generated / self._log["time/generate_s"]

    def _staleness(self, step: int, samples: list[Sample]) -> dict[str, Any]:
        versions = [s.rollout.version for s in samples]
        record = {"rollout/version_min": min(versions), "rollout/version_max": max(versions),
                  "rollout/staleness_max": step - min(versions), "rollout/staleness_min": step - max(versions)}
        trained = [s.rollout for s in samples if s.rollout.train_logprobs is not None]  # zero-signal groups: not scored
        if trained:
            record.update(mismatch_figures([trained_values(r, r.train_logprobs) for r in trained],
                                           [trained_values(r, r.logprobs) for r in trained]))
        return record

    def next_step(self, step: int, model: torch.nn.Module) -> StepBatch:  # noqa: ARG002 - rollouts hold the model
        self._log, self._generated = {}, 0
        self._drop_ahead()
        queued = self._rollouts_for(step)
        kept = queued.groups
        self._pending = queued.outcomes
        advantages = self._advantages(kept).tolist()
        sequences = [(s, a) for s, a in zip([s for g in kept for s in g.samples], advantages, strict=True)]
        self.last_groups, self.last_sequences = kept, sequences  # the step as trained, for inspection
        counted = [not (self.rl.mask_truncated and s.truncated) for s, _ in sequences]
        updates = self.rl.updates_per_rollout
        per_update = len(sequences) // updates
        normalizers = []
        for u in range(updates):
            part = range(u * per_update, (u + 1) * per_update)
            loss_tokens = sum(trained_count(sequences[i][0].rollout) for i in part if counted[i])
            sequences_counted = sum(counted[i] for i in part)
            # Every completion of the update masked (all truncated under rl.mask_truncated): its loss is 0;
            # divide by 1 rather than refuse the step.
            normalizers.append(float(self.aggregation.denominator(total_tokens=max(loss_tokens, 1),
                                                                  total_sequences=max(sequences_counted, 1))))
        micro_batches = self._micro_batches(sequences, counted, normalizers, per_update)
        if self.reference is not None:
            for batch in micro_batches:
                batch["ref_logprobs"] = self.reference(batch)
        self._log.update(queued.metrics)
        self._log.update(self._staleness(step, [s for s, _ in sequences]))
        self._log.update({key: value for key, value in self.counters.items()})
        self._log["sampler_skipped"] = self.sampler.skipped
        total_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s, _ in sequences)
        loss_tokens = sum(trained_count(s.rollout) for (s, _), c in zip(sequences, counted, strict=True) if c)
        self._throughput()
        self._sampled_at = time.perf_counter()
        return StepBatch(micro_batches=micro_batches, normalizer=normalizers, updates=updates, tokens=total_tokens,
                         loss_tokens=loss_tokens, log=self._log,
                         unit_ids=[self.prompts[g.prompt_index].id for g in kept],
                         before_update=self.collect_ahead if self._ahead is not None else None)

    def _micro_batches(self, sequences: list[tuple[Sample, float]], counted: list[bool], normalizers: list[float],
                       per_update: int) -> list[dict[str, Any]]:
        """This rank's micro-batches, update by update.

        With ``rl.skip_zero_advantage`` (and no KL term) a completion whose advantage is exactly 0 — every
        member of a zero-signal group — is left out of the forward: its policy-gradient term is exactly 0,
        so the update is the same, while its tokens still count in the normaliser. The trained completions
        are dealt over ranks as a stream is (rank ``r``'s micro-batch ``a`` holds ``(a·W + r)·B …``), with
        the same number of micro-batches on every rank (FSDP's collectives need it): a rank left without
        completions runs one with advantage 0 and no weight in the metrics.
        """
        world, rank, size = dist.world_size(), dist.rank(), self.geometry.micro_batch
        skip = self.rl.skip_zero_advantage and self.rl.kl_beta == 0
        trained_parts = []
        for u in range(self.rl.updates_per_rollout):
            part = range(u * per_update, (u + 1) * per_update)
            trained_parts.append([i for i in part if counted[i] and sequences[i][1] != 0.0] if skip else list(part))
        micro_per_update = (max(1, *(math.ceil(len(t) / (world * size)) for t in trained_parts)) if skip
                            else self.geometry.grad_accum // self.rl.updates_per_rollout)
        self._log["trained_completions"] = sum(len(t) for t in trained_parts)
        batches = []
        for u, trained in enumerate(trained_parts):
            trained_tokens = sum(trained_count(sequences[i][0].rollout) for i in trained if counted[i])
            for a in range(micro_per_update):
                start = (a * world + rank) * size
                chosen = trained[start : start + size]
                if chosen:
                    batch = self.collate([sequences[i] for i in chosen], [counted[i] for i in chosen])
                    # The log divides metric sums by the update's normaliser; normaliser / trained tokens
                    # makes each logged figure a per-token mean over the trained tokens, whatever the aggregation.
                    batch["metric_scale"] = normalizers[u] / max(trained_tokens, 1)
                else:
                    batch = self.collate([(sequences[0][0], 0.0)], [True])
                    batch["metric_scale"] = 0.0
                batches.append(batch)
        return batches

    def collate(self, sequences: list[tuple[Sample, float]], counted: list[bool]) -> dict[str, Any]:
        """``rollout_batch``'s rows (right-padded prompt + completion, old log-probs aligned with the labels)
        with the advantages; a completion left out of the loss (``rl.mask_truncated``) keeps no label."""
        from posttrain.models.logprobs import IGNORE_INDEX, POSITION_KEYS, loss_positions

        batch = rollout_batch([sample.rollout for sample, _ in sequences], self.pad_id, self.rl.temperature)
        dropped = torch.tensor([not keep for keep in counted])
        batch["labels"][dropped] = IGNORE_INDEX
        batch["advantages"] = torch.tensor([a for _, a in sequences], dtype=torch.float32)
        batch.update(loss_positions(batch["labels"]))  # found here, on the host: no mask selection on the device
        device = dist.device()
        # No attention mask: rows are right-padded, so under causal attention no real token sees a pad.
        keys = ("input_ids", "labels", "old_logprobs", "advantages", *POSITION_KEYS)
        if self.rl.is_correction != "none":  # the ratio's old policy is the trainer's, the sampler's is reweighed
            if any(s.rollout.train_logprobs is None and a != 0.0 for s, a in sequences):
                raise RuntimeError("a completion with an advantage was not scored by the trainer (trainer_logprobs)")
            rollouts = [sample.rollout for sample, _ in sequences]
            batch["behaviour_logprobs"] = batch["old_logprobs"]
            # a completion left unscored (zero signal, advantage 0: no gradient) keeps the sampler's numbers
            train = [r.logprobs if r.train_logprobs is None else r.train_logprobs for r in rollouts]
            batch["old_logprobs"] = token_layout(rollouts, train, batch["labels"].shape[1])
            keys = (*keys, "behaviour_logprobs")
        if "routed_experts" in batch:  # rl.routing_replay: the sampler's experts, [B, L, layers, K]
            keys = (*keys, "routed_experts")
        return {key: batch[key].to(device) for key in keys}

    # ------------------------------------------------------------------ state

    def end_step(self, step: int, accepted: bool, metric_sums: dict[str, float]) -> dict[str, Any]:  # noqa: ARG002
        self._drop_ahead()
        if accepted:
            self.sampler.record(self._pending)
        self._pending = {}
        self.queue = [queued for queued in self.queue if queued.step > step]
        return {"time/train_s": time.perf_counter() - self._sampled_at}

    def _drop_ahead(self) -> None:
        """A draw left in flight (its step never reached its update): wait for the engine and drop it; the step
        it was for is sampled again when due, with that step's weights."""
        if self._ahead is not None and self._ahead.pending is not None:
            self._ahead.pending[1].result()
            self.counters["rollout/overlap_dropped"] += 1
        self._ahead = None

    def state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state(), "counters": dict(self.counters),
                "prompts_per_step": self.prompts_per_step, "group_size": self.rl.group_size,
                "queue": [queued.encode() for queued in self.queue]}

    def load_state(self, state: dict[str, Any]) -> None:
        for key, mine in (("prompts_per_step", self.prompts_per_step), ("group_size", self.rl.group_size)):
            if state.get(key, mine) != mine:
                raise ValueError(f"the checkpoint was written with {key}={state[key]}, this run has {mine}; resume "
                                 "with the same train.global_batch_size and rl.group_size")
        self.sampler.load_state(state["sampler"])
        self.counters = Counter(state.get("counters", {}))
        self._pending = {}
        # Rollouts sampled ahead before the checkpoint (rl.max_staleness); a changed k only moves the lag.
        self.queue = [Queued.decode(queued) for queued in state.get("queue", [])]
