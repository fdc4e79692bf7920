"""``posttrain dpo``: preference alignment with the DPO family of losses, on the shared training loop.

setup → reference → train → evaluate → export:

1. read and tokenise the pairs (bad records raise or are quarantined; pairs that truncation spoils are
   dropped with a reason; ``pairs.jsonl`` lists every pair used, with the annotator's rationale); fewer
   than ``dpo.min_pairs`` stop here, before any model loads (``TooFewPairs``, exit 2), and the passes over
   a tiny set are capped (``cap_tiny_set``);
2. reference log-probs: precomputed once and cached (``posttrain.train.reference``; the reference model
   is freed before the policy is even loaded), or a live reference kept beside the policy, or none.
   With ``model.lora`` (and no other ``dpo.reference_model``) no reference model is loaded at all: the
   policy with its adapters disabled is the base, and it serves both the precomputed and the live mode;
3. the loop (``posttrain.train.loop``) with a ``DPOSource`` — the pair stream, each micro-batch carrying
   its reference log-probs and BCO's current shift δ (source state, checkpointed and restored on
   rollback) — and ``dpo_loss``: one forward per micro-batch over chosen and rejected together, the
   loss from ``posttrain.algorithms.preference.LOSSES``;
4. with ``data.eval``: held-out loss and accuracies before training, every ``train.eval_every`` steps
   and after training (``eval.json``, ``metrics.jsonl``);
5. export the policy in HF format to ``output_dir/final``.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from posttrain import dist
from posttrain.algorithms.preference import (
    chosen_sft_term,
    combine_losses,
    fold_running_mean,
    preference_metrics,
)
from posttrain.config.preference import DPORecipe
from posttrain.data.io import append_jsonl
from posttrain.models.attention import attention_for
from posttrain.models.load import load_model
from posttrain.models.lora import adapter_disabled
from posttrain.train.evaluation import chunk_sums, sharded_sums
from posttrain.train.loop import train
from posttrain.train.pairs import (
    TINY_SET_EPOCHS,
    TINY_SET_PAIRS,
    PairData,
    PairLogprobModel,
    TokenizedPair,
    TooFewPairs,
    collate_pairs,
    model_inputs,
    pair_summary,
    read_pairs,
    split_pairs,
    write_jsonl,
)
from posttrain.train.parallelize import uses_fsdp
from posttrain.train.precision import autocast
from posttrain.train.reference import ReferenceSpec, default_cache_dir, reference_logps
from posttrain.train.runner import (
    Run,
    batch_geometry,
    build_policy,
    export_final,
    finish,
    loop_settings,
    peek_data,
    say,
    start_run,
)
from posttrain.train.sft import curriculum_items
from posttrain.train.source import BatchGeometry, StepBatch, StreamSource
from posttrain.train.stream import Difficulty, build_stream

# Keys of the per-step metrics (besides the loop's loss, grad_norm, lr, throughput): sums over pairs
# that the loop divides by the step's pair count.
METRIC_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
               "logps/rejected", "kl_to_ref")


def reference_spec(config: DPORecipe) -> ReferenceSpec:
    return ReferenceSpec(
        path=config.dpo.reference_model or config.model.path,
        dtype=config.model.dtype,
        attn_implementation=attention_for(config.model, config.train.precision),
        trust_remote_code=config.model.trust_remote_code,
        precision=config.train.precision,
        prefix_sharing=config.dpo.prefix_sharing,
        batch_size=config.dpo.reference_batch_size,
        chunk_size=config.train.loss_chunk_size,
    )


def load_live_reference(spec: ReferenceSpec) -> PairLogprobModel:
    """The frozen reference for ``dpo.reference=live``: unsharded, no grad, on this rank's device."""
    lm = load_model(spec.path, spec.dtype, spec.attn_implementation, spec.trust_remote_code, device=dist.device())
    lm.config.use_cache = False
    lm.eval().requires_grad_(False)
    return PairLogprobModel(lm, chunk_size=spec.chunk_size)


def check_pair_count(config: DPORecipe, pairs: int) -> None:
    """Stop below ``dpo.min_pairs``; over a tiny set (a lowered minimum) cap the passes over it at
    ``TINY_SET_EPOCHS``, shortening ``train.max_steps`` (or ``train.epochs``) with a warning line."""
    if pairs < config.dpo.min_pairs:
        raise TooFewPairs(config.data.train, pairs, config.dpo.min_pairs)
    train = config.train
    planned = train.max_steps * train.global_batch if train.max_steps is not None else (train.epochs or 1.0) * pairs
    if pairs >= TINY_SET_PAIRS or planned <= TINY_SET_EPOCHS * pairs:
        return
    if train.max_steps is not None:
        asked = f"train.max_steps={train.max_steps} × {train.global_batch}"
        train.max_steps = max(1, TINY_SET_EPOCHS * pairs // train.global_batch)  # at least one full step
        capped = f"train.max_steps={train.max_steps}"
    else:
        capped, asked = f"train.epochs={TINY_SET_EPOCHS}", f"train.epochs={train.epochs:g}"
        train.epochs = float(TINY_SET_EPOCHS)
    say(f"warning: only {pairs} pairs (fewer than {TINY_SET_PAIRS}): {asked} would pass over them "
        f"{planned / pairs:.0f} times, which memorises them; capped at {TINY_SET_EPOCHS} passes: {capped}. "
        "Add pairs rather than steps")


def build_units(config: DPORecipe, pairs: list[TokenizedPair]) -> list[TokenizedPair]:
    """Pairs in consumption order: the same stream (seeded shuffle or curriculum) as SFT uses."""
    train_cfg, data = config.train, config.data
    items = curriculum_items(config, [Difficulty(p.tier, p.difficulty) for p in pairs])
    order = build_stream(
        items, data.curriculum, train_cfg.seed, train_cfg.epochs, train_cfg.global_batch, train_cfg.max_steps,
        data.competence_start, data.competence_steps, data.shuffle,
    )
    return [pairs[i] for i in order]


class ReferenceLogps:
    """Where a batch's reference log-probs come from: a precomputed table, a live model, or nowhere.

    ``attach(batch)`` adds ``ref_chosen`` / ``ref_rejected`` (``[B]``) to a collated batch.
    """

    def __init__(self, table: tuple[torch.Tensor, torch.Tensor] | None = None, live: PairLogprobModel | None = None,
                 precision: str = "fp32", sharded: bool = False):
        # ``sharded``: ``live`` is the FSDP-sharded LoRA policy (its base, adapters off), not a whole reference.
        self.table, self.live, self.precision, self.sharded = table, live, precision, sharded

    def attach(self, batch: dict[str, Any]) -> dict[str, Any]:
        device = dist.device()
        if self.table is not None:
            index = batch["pair_index"]
            batch["ref_chosen"], batch["ref_rejected"] = self.table[0][index].to(device), self.table[1][index].to(device)
        elif self.live is not None:
            # A separate frozen reference is never sharded: bf16 runs compute it under autocast.
            with torch.no_grad(), autocast(self.precision, self.sharded), adapter_disabled(self.live):
                batch["ref_chosen"], batch["ref_rejected"] = split_pairs(self.live(**model_inputs(batch)).float())
        return batch


def pair_losses(config: DPORecipe, batch: dict[str, Any], policy_logps: torch.Tensor):
    """Per-pair loss ``[B]`` (preference losses + optional chosen-NLL term) and the pieces metrics need.

    Reads the reference log-probs (``ref_chosen``/``ref_rejected``) and BCO's shift (``bco_delta``) from
    the batch, where ``ReferenceLogps`` and ``DPOSource`` put them.
    """
    dpo = config.dpo
    pc, pr = split_pairs(policy_logps.float())
    rc, rr = batch.get("ref_chosen"), batch.get("ref_rejected")
    device = pc.device
    lc, lr = batch["chosen_lengths"].to(device), batch["rejected_lengths"].to(device)
    params = dpo.loss_params()
    if "bco_pair" in dpo.losses and dpo.bco_delta is None:
        params["bco_delta"] = batch["bco_delta"]
    per_pair = combine_losses(dpo.losses, dpo.loss_weights, pc, pr, rc, rr, chosen_lengths=lc, rejected_lengths=lr,
                              **params)
    sft = chosen_sft_term(-pc, lc, dpo.sft_weight) if dpo.sft_weight > 0 else None
    if sft is not None:
        per_pair = per_pair + sft
    return per_pair, (pc, pr, rc, rr, lc, lr), sft


def dpo_loss(config: DPORecipe):
    """The loss the loop calls per micro-batch: summed per-pair loss and metric sums over the pairs."""

    def loss(model: torch.nn.Module, batch: dict[str, Any]):
        per_pair, (pc, pr, rc, rr, lc, lr), sft = pair_losses(config, batch, model(**model_inputs(batch)))
        count = pc.shape[0]
        means = preference_metrics(pc, pr, rc, rr, beta=config.dpo.beta, chosen_lengths=lc, rejected_lengths=lr)
        metrics = {key: value * count for key, value in means.items()}
        if rc is not None:
            # Per pair, then summed: a mean over pairs that does not depend on how pairs are split into
            # micro-batches or ranks (preference_metrics' token-weighted mean would).
            metrics["kl_to_ref"] = (((pc - rc) + (pr - rr)) / (lc + lr)).detach().sum()
        if sft is not None:
            metrics["loss/sft"] = sft.detach().sum()
        return per_pair.sum(), metrics

    return loss


class DPOSource(StreamSource):
    """The pair stream; every micro-batch carries its reference log-probs and BCO's shift δ.

    δ (``dpo.loss: bco_pair`` without a fixed ``dpo.bco_delta``) is the running mean of the implicit
    rewards ``β·ρ`` over chosen and rejected of every pair trained on so far. It is source state: one
    value for the whole step (so accumulation and ranks do not change the step), folded in after each
    accepted step from the step's global reward sums, saved with every checkpoint, restored on resume
    and on rollback.
    """

    def __init__(self, config: DPORecipe, units: list[TokenizedPair], geometry: BatchGeometry, pad_id: int,
                 reference: ReferenceLogps):
        prefix_sharing = config.dpo.prefix_sharing
        tiers: Counter = Counter()

        def describe(pairs: list[TokenizedPair]) -> dict[str, int]:
            tiers.clear()
            tiers.update(p.tier for p in pairs)
            return {f"tier_{t if t is not None else 'none'}": n for t, n in sorted(tiers.items(), key=lambda kv: str(kv[0]))}

        def token_counts(pairs: list[TokenizedPair]) -> tuple[int, int]:
            return (sum(p.row_tokens(prefix_sharing) for p in pairs),
                    sum(len(p.chosen_targets) + len(p.rejected_targets) for p in pairs))

        super().__init__("dpo", units, geometry, collate=lambda pairs: collate_pairs(pairs, pad_id, prefix_sharing),
                         normalizer=len, rank=dist.rank(), describe=describe, token_counts=token_counts,
                         unit_ids=lambda pair: [pair.id])
        self.reference = reference
        self.running_bco = "bco_pair" in config.dpo.losses and config.dpo.bco_delta is None
        self.bco_mean, self.bco_count = 0.0, 0

    def next_step(self, step: int, model: torch.nn.Module) -> StepBatch:
        batch = super().next_step(step, model)
        for micro in batch.micro_batches:
            self.reference.attach(micro)
            micro["bco_delta"] = self.bco_mean
        return batch

    def end_step(self, step: int, accepted: bool, metric_sums: dict[str, float]) -> None:
        super().end_step(step, accepted, metric_sums)
        if self.running_bco and accepted:
            rewards = metric_sums["rewards/chosen"] + metric_sums["rewards/rejected"]
            self.bco_mean, self.bco_count = fold_running_mean(self.bco_mean, self.bco_count, rewards,
                                                              2 * self.geometry.global_batch)

    def state(self) -> dict[str, Any]:
        return {**super().state(), "bco_mean": self.bco_mean, "bco_count": self.bco_count}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.bco_mean, self.bco_count = float(state["bco_mean"]), int(state["bco_count"])


def pair_evaluator(config: DPORecipe, pairs: list[TokenizedPair], pad_id: int, reference: ReferenceLogps,
                   source: DPOSource | None, sharded: bool):
    """``evaluate(model)``: held-out preference figures over ``pairs`` (sharded over ranks).

    - ``loss``: the training loss; ``rewards/accuracy``: implicit reward margin > 0 (DPO's usual metric;
      0 before training when the reference is the initial policy, since every margin is then 0);
    - ``logps_accuracy``: the policy gives the chosen response a higher summed log-prob than the rejected
      one — meaningful before and after training, so it shows what training changed.
    """

    def measure(model: torch.nn.Module, chunk: list[TokenizedPair]) -> torch.Tensor:
        batch = reference.attach(collate_pairs(chunk, pad_id, config.dpo.prefix_sharing))
        batch["bco_delta"] = source.bco_mean if source is not None else 0.0
        with autocast(config.train.precision, sharded):
            per_pair, (pc, pr, rc, rr, lc, lr), _ = pair_losses(config, batch, model(**model_inputs(batch)))
        margin = config.dpo.beta * (((pc - rc) - (pr - rr)) if rc is not None else (pc / lc - pr / lr))
        return chunk_sums(per_pair.sum(), (margin > 0).sum(), margin.sum(), (pc > pr).sum(), (pc / lc > pr / lr).sum(),
                          count=pc.shape[0])

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        totals = sharded_sums(model, pairs, config.train.batch_size, measure)
        count = max(float(totals[5]), 1.0)
        return {
            "loss": float(totals[0]) / count,
            "rewards/accuracy": float(totals[1]) / count,
            "rewards/margin": float(totals[2]) / count,
            "logps_accuracy": float(totals[3]) / count,
            "logps_per_token_accuracy": float(totals[4]) / count,
            "pairs": int(totals[5]),
        }

    return evaluate


def uses_adapter_reference(config: DPORecipe) -> bool:
    """LoRA with the base as the reference: the policy with its adapters disabled serves as the reference."""
    return (config.model.lora is not None and config.dpo.reference_mode != "none"
            and reference_spec(config).path == config.model.path)


def prepare_reference(config: DPORecipe, run: Run, train_data: PairData, eval_data: PairData | None, pad_id: int,
                      policy: torch.nn.Module | None = None, sharded: bool = False):
    """Reference log-probs for training and evaluation, per ``dpo.reference``.

    ``policy``: the LoRA policy's root, whose adapter-disabled base is the reference (``sharded``: under FSDP).
    """
    mode = config.dpo.reference_mode
    precision = config.train.precision
    if mode == "none":
        say("reference: none (reference-free loss)")
        return ReferenceLogps(), ReferenceLogps()
    spec = reference_spec(config)
    if policy is not None:
        spec = dataclasses.replace(spec, source="policy-adapter-disabled")
    if mode == "live":
        if policy is not None:
            say(f"reference: live, the LoRA policy with its adapters disabled ({spec.path}; no second model)")
            live = ReferenceLogps(live=policy, precision=precision, sharded=sharded)
        else:
            say(f"reference: live ({spec.path}, kept in memory beside the policy)")
            live = ReferenceLogps(live=load_live_reference(spec), precision=precision)
        return live, live
    cache_dir = Path(config.dpo.reference_cache_dir) if config.dpo.reference_cache_dir else \
        default_cache_dir(config.output_dir)
    sources = []
    for path, data in ((config.data.train, train_data), (config.data.eval, eval_data)):
        if data is None:
            sources.append(ReferenceLogps())
            continue
        result = reference_logps(spec, data.pairs, pad_id, path, cache_dir, desc=f"reference log-probs {path}",
                                 policy=policy, sharded=sharded)
        say(f"reference log-probs for {len(data.pairs)} pairs of {path}: "
            f"{'reused' if result.reused else 'computed and cached'} {result.path}")
        sources.append(ReferenceLogps(table=(result.chosen, result.rejected)))
    return sources[0], sources[1]


def _write_outputs(run: Run, data: PairData, units: list[TokenizedPair], train_ref: ReferenceLogps) -> None:
    uses = Counter(p.index for p in units)
    rows = []
    for pair in data.pairs:
        extra = {"uses": uses.get(pair.index, 0)}
        if train_ref.table is not None:
            extra["ref_chosen_logp"] = float(train_ref.table[0][pair.index])
            extra["ref_rejected_logp"] = float(train_ref.table[1][pair.index])
        rows.append(pair_summary(pair, extra))
    write_jsonl(run.output_dir / "pairs.jsonl", rows)
    if data.dropped_ids:
        write_jsonl(run.output_dir / "dropped_pairs.jsonl", [{"id": i, "reason": r} for i, r in data.dropped_ids])


def write_eval(output_dir: Path, step: int, before: dict, after: dict, shown: tuple[str, ...]) -> None:
    """``eval.json`` (before/after) and two ``eval_phase`` lines in ``metrics.jsonl`` (rank 0)."""
    if not dist.is_main():
        return
    (output_dir / "eval.json").write_text(json.dumps({"before": before, "after": after}, indent=1))
    append_jsonl(str(output_dir / "metrics.jsonl"), [
        {"step": step, "eval_phase": phase, **{f"eval/{k}": v for k, v in values.items()}}
        for phase, values in (("before_training", before), ("after_training", after))
    ])
    say("held-out: " + "; ".join(f"{k} {before[k]:.3f} → {after[k]:.3f}" for k in shown))


def run_dpo(config: DPORecipe) -> int:
    run = start_run(config, check_data=lambda c: peek_data(c, "preference"))  # bad data stops before any run state
    try:
        if run.finished:
            return 0
        geometry = batch_geometry(config)
        from posttrain.models.load import load_tokenizer

        tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
        pad_id = tokenizer.pad_token_id
        train_data = read_pairs(config, config.data.train, tokenizer, "")
        check_pair_count(config, len(train_data.pairs))
        eval_data = read_pairs(config, config.data.eval, tokenizer, "-eval") if config.data.eval else None
        adapter_reference = uses_adapter_reference(config)
        if not adapter_reference:
            # The reference pass runs (and frees its model) before the policy is loaded: peak memory is one model.
            train_ref, eval_ref = prepare_reference(config, run, train_data, eval_data, pad_id)
        root, lm, tokenizer = build_policy(config, lambda lm: PairLogprobModel(lm, config.train.loss_chunk_size))
        if adapter_reference:  # LoRA: the policy with its adapters disabled is the reference
            train_ref, eval_ref = prepare_reference(config, run, train_data, eval_data, pad_id, policy=root,
                                                    sharded=uses_fsdp(config.train.fsdp))
        units = build_units(config, train_data.pairs)
        leftover = len(units) % geometry.global_batch
        say(f"{len(units)} pairs → {len(units) // geometry.global_batch} steps of {geometry.global_batch}"
            + (f"; the last {leftover} do not fill a step and are not used" if leftover else ""))
        _write_outputs(run, train_data, units, train_ref)
        source = DPOSource(config, units, geometry, pad_id, train_ref)
        settings = loop_settings(run, lm)
        before = None
        if eval_data is not None:
            settings.evaluate = pair_evaluator(config, eval_data.pairs, pad_id, eval_ref, source, settings.sharded)
            before = settings.evaluate(root)
        code = train(root, source, dpo_loss(config), settings)
        if code == 0:
            if before is not None:
                write_eval(run.output_dir, source.total_steps(), before, settings.summary.evals[-1][1],
                           ("loss", "rewards/accuracy", "logps_accuracy"))
            finish("dpo", run, settings, export_final(run, root, lm, tokenizer))
        return code
    finally:
        dist.destroy()
