"""``posttrain dpo``: preference alignment with the DPO family of losses, on the shared training loop.

setup → reference → train → evaluate → export:

1. read and tokenise the pairs (bad records raise or are quarantined; pairs that truncation spoils are
   dropped with a reason; ``pairs.jsonl`` lists every pair used, with the annotator's rationale);
2. reference log-probs: precomputed once and cached (``posttrain.train.reference``; the reference model
   is freed before the policy is even loaded), or a live reference kept beside the policy, or none;
3. the loop (``posttrain.train.loop``) with a preference ``Objective``: one forward per micro-batch
   over chosen and rejected together, the loss from ``posttrain.algorithms.preference.LOSSES``;
4. with ``data.eval``: held-out loss and accuracies before and after training (``eval.json``);
5. export the policy in HF format to ``output_dir/final``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import torch

from posttrain import dist
from posttrain.algorithms.preference import (
    chosen_sft_term,
    combine_losses,
    preference_metrics,
    update_running_mean,
)
from posttrain.config.preference import DPORecipe
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.tiny import count_parameters
from posttrain.train.checkpoint import latest_valid_checkpoint
from posttrain.train.loop import Objective, train
from posttrain.train.pairs import (
    PairData,
    PairLogprobModel,
    TokenizedPair,
    collate_pairs,
    model_inputs,
    pair_summary,
    read_pairs,
    recompute_gated_mlp,
    split_pairs,
    write_jsonl,
)
from posttrain.train.parallelize import parallelize
from posttrain.train.reference import ReferenceSpec, default_cache_dir, reference_logps
from posttrain.train.runner import Run, export_final, loop_settings, say, start_run
from posttrain.train.stream import Difficulty, build_stream

# Keys of the per-step metrics (besides the loop's loss, grad_norm, lr, throughput): sums over pairs
# that the loop divides by the step's pair count.
METRIC_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
               "logps/rejected", "kl_to_ref")


def parallelize_root(config, root: torch.nn.Module, lm: torch.nn.Module) -> None:
    """AC + FSDP through the one ``parallelize`` function, as ``runner.load_policy`` does for SFT."""
    train_cfg = config.train
    applied = parallelize(
        root, lm, fsdp=train_cfg.fsdp, precision=train_cfg.precision, cpu_offload=train_cfg.cpu_offload,
        activation_checkpointing=train_cfg.activation_checkpointing, ac_every=train_cfg.ac_every,
    )
    say(f"model {config.model.path}: {count_parameters(lm) / 1e6:.2f}M parameters; {applied}")


def lean_mlp(lm: torch.nn.Module) -> None:
    changed = recompute_gated_mlp(lm)
    if changed:
        say(f"{changed} gated MLPs recompute act(gate)·up and the down projection in backward (less activation memory)")


def reshard(root: torch.nn.Module) -> None:
    """After a forward without backward, put FSDP2's root parameters back to their sharded form.

    FSDP2 keeps the root's parameters unsharded after its forward (backward would reshard them). An
    evaluation pass has no backward, and an optimizer built afterwards would then hold the unsharded
    tensors instead of the sharded parameters.
    """
    if hasattr(root, "reshard"):
        root.reshard()


def reference_spec(config: DPORecipe) -> ReferenceSpec:
    return ReferenceSpec(
        path=config.dpo.reference_model or config.model.path,
        dtype=config.model.dtype,
        attn_implementation=config.model.attn_implementation,
        trust_remote_code=config.model.trust_remote_code,
        autocast_bf16=config.train.precision == "bf16",
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


def build_units(config: DPORecipe, pairs: list[TokenizedPair], world: int) -> list[TokenizedPair]:
    """Pairs in consumption order: the same stream (seeded shuffle or curriculum) as SFT uses."""
    train_cfg, data = config.train, config.data
    order = build_stream(
        [Difficulty(p.tier, p.difficulty) for p in pairs], data.curriculum, train_cfg.seed, train_cfg.epochs,
        train_cfg.batch_size * train_cfg.grad_accum * world, train_cfg.max_steps, data.competence_start,
        data.competence_steps, data.shuffle,
    )
    return [pairs[i] for i in order]


class ReferenceSource:
    """Where a batch's reference log-probs come from: a precomputed table, a live model, or nowhere."""

    def __init__(self, table: tuple[torch.Tensor, torch.Tensor] | None = None, live: PairLogprobModel | None = None):
        self.table, self.live = table, live

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        device = dist.device()
        if self.table is not None:
            index = batch["pair_index"]
            return self.table[0][index].to(device), self.table[1][index].to(device)
        if self.live is not None:
            with torch.no_grad():
                return split_pairs(self.live(**model_inputs(batch)).float())
        return None, None


def pair_losses(config: DPORecipe, batch, policy_logps: torch.Tensor, reference: ReferenceSource, bco_delta: float):
    """Per-pair loss ``[B]`` (preference losses + optional chosen-NLL term) and the pieces metrics need."""
    dpo = config.dpo
    pc, pr = split_pairs(policy_logps.float())
    rc, rr = reference(batch)
    device = pc.device
    lc, lr = batch["chosen_lengths"].to(device), batch["rejected_lengths"].to(device)
    params = dpo.loss_params()
    if "bco_pair" in dpo.losses and dpo.bco_delta is None:
        params["bco_delta"] = bco_delta
    per_pair = combine_losses(dpo.losses, dpo.loss_weights, pc, pr, rc, rr, chosen_lengths=lc, rejected_lengths=lr,
                              **params)
    sft = chosen_sft_term(-pc, lc, dpo.sft_weight) if dpo.sft_weight > 0 else None
    if sft is not None:
        per_pair = per_pair + sft
    return per_pair, (pc, pr, rc, rr, lc, lr), sft


def dpo_objective(
    config: DPORecipe, units: list[TokenizedPair], pad_id: int, reference: ReferenceSource, bco: dict
) -> Objective:
    prefix_sharing = config.dpo.prefix_sharing
    running_bco = _running_bco(config)
    tiers = Counter()

    def collate(pairs: list[TokenizedPair]) -> dict[str, torch.Tensor]:
        return collate_pairs(pairs, pad_id, prefix_sharing)

    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        per_pair, (pc, pr, rc, rr, lc, lr), sft = pair_losses(
            config, batch, model(**model_inputs(batch)), reference, bco["bco_mean"]
        )
        count = pc.shape[0]
        means = preference_metrics(pc, pr, rc, rr, beta=config.dpo.beta, chosen_lengths=lc, rejected_lengths=lr)
        metrics = {key: value * count for key, value in means.items()}
        if rc is not None:
            # Per pair, then summed: a mean over pairs that does not depend on how pairs are split into
            # micro-batches or ranks (preference_metrics' token-weighted mean would).
            metrics["kl_to_ref"] = float((((pc - rc) + (pr - rr)) / (lc + lr)).detach().sum())
        if sft is not None:
            metrics["loss/sft"] = float(sft.detach().sum())
        if running_bco and model.training:
            _update_bco_delta(bco, config.dpo.beta, pc, pr, rc, rr)
        return per_pair.sum(), metrics

    def describe(pairs: list[TokenizedPair]) -> dict[str, int]:
        tiers.clear()
        tiers.update(p.tier for p in pairs)
        return {f"tier_{t if t is not None else 'none'}": n for t, n in sorted(tiers.items(), key=lambda kv: str(kv[0]))}

    def token_counts(pairs: list[TokenizedPair]) -> tuple[int, int]:
        return (
            sum(p.row_tokens(prefix_sharing) for p in pairs),
            sum(len(p.chosen_targets) + len(p.rejected_targets) for p in pairs),
        )

    return Objective(
        name="dpo", units=units, collate=collate, normalizer=len, loss=loss, describe=describe,
        token_counts=token_counts,
    )


def _running_bco(config: DPORecipe) -> bool:
    return "bco_pair" in config.dpo.losses and config.dpo.bco_delta is None


def _update_bco_delta(bco: dict, beta: float, pc, pr, rc, rr) -> None:
    """BCO's δ: running mean of the rewards β·ρ over chosen and rejected of every rank's pairs."""
    rewards = beta * torch.cat([(pc - rc), (pr - rr)]).detach().float().cpu()
    gathered = torch.zeros(dist.world_size(), rewards.numel(), dtype=torch.float32)
    gathered[dist.rank()] = rewards
    dist.all_reduce_sum(gathered)  # every rank ends with the same δ
    bco["bco_mean"], bco["bco_count"] = update_running_mean(bco["bco_mean"], bco["bco_count"], gathered.flatten())


def _restore_bco_state(run: Run, bco: dict) -> None:
    """On resume, take δ from the checkpoint the loop is about to resume from (it saves ``extra_state``)."""
    info = latest_valid_checkpoint(run.output_dir / "checkpoints", run.config_hash)
    if info is None:
        return
    saved = json.loads((info.path / f"trainer-rank{dist.rank()}.json").read_text())
    for key in ("bco_mean", "bco_count"):
        if key in saved:
            bco[key] = saved[key]


@torch.no_grad()
def evaluate_pairs(
    config: DPORecipe, root: torch.nn.Module, pairs: list[TokenizedPair], pad_id: int, reference: ReferenceSource,
    bco_delta: float = 0.0,
) -> dict[str, float]:
    """Held-out preference figures over ``pairs`` (sharded over ranks; every rank runs the same forwards).

    - ``loss``: the training loss; ``rewards/accuracy``: implicit reward margin > 0 (DPO's usual metric;
      0 before training when the reference is the initial policy, since every margin is then 0);
    - ``logps_accuracy``: the policy gives the chosen response a higher summed log-prob than the rejected
      one — meaningful before and after training, so it shows what training changed.
    """
    batch_size, world, rank = config.train.batch_size, dist.world_size(), dist.rank()
    totals = torch.zeros(6, dtype=torch.float64)
    root.eval()
    rounds = math.ceil(len(pairs) / (batch_size * world))
    for index in range(rounds):
        start = (index * world + rank) * batch_size
        chunk = pairs[start : start + batch_size]
        weight = 1.0 if chunk else 0.0
        batch = collate_pairs(chunk or pairs[:1], pad_id, config.dpo.prefix_sharing)
        with _eval_autocast(config):
            per_pair, (pc, pr, rc, rr, lc, lr), _ = pair_losses(config, batch, root(**model_inputs(batch)),
                                                                reference, bco_delta)
        if rc is not None:
            margin = config.dpo.beta * ((pc - rc) - (pr - rr))
        else:
            margin = config.dpo.beta * (pc / lc - pr / lr)
        totals += weight * torch.tensor([
            float(per_pair.sum()), float((margin > 0).sum()), float(margin.sum()), float((pc > pr).sum()),
            float((pc / lc > pr / lr).sum()), float(pc.shape[0]),
        ], dtype=torch.float64)
    root.train()
    reshard(root)
    dist.all_reduce_sum(totals)
    count = max(float(totals[5]), 1.0)
    return {
        "loss": float(totals[0]) / count,
        "rewards/accuracy": float(totals[1]) / count,
        "rewards/margin": float(totals[2]) / count,
        "logps_accuracy": float(totals[3]) / count,
        "logps_per_token_accuracy": float(totals[4]) / count,
        "pairs": int(totals[5]),
    }


def _eval_autocast(config: DPORecipe):
    import contextlib

    uses_fsdp = dist.world_size() > 1 or config.train.fsdp == "on"
    if config.train.precision != "bf16" or uses_fsdp:
        return contextlib.nullcontext()
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)


def prepare_reference(config: DPORecipe, run: Run, train_data: PairData, eval_data: PairData | None, pad_id: int):
    """Reference sources for training and evaluation, per ``dpo.reference``."""
    mode = config.dpo.reference_mode
    if mode == "none":
        say("reference: none (reference-free loss)")
        return ReferenceSource(), ReferenceSource()
    spec = reference_spec(config)
    if mode == "live":
        say(f"reference: live ({spec.path}, kept in memory beside the policy)")
        live = ReferenceSource(live=load_live_reference(spec))
        return live, live
    sources = []
    for path, data in ((config.data.train, train_data), (config.data.eval, eval_data)):
        if data is None:
            sources.append(ReferenceSource())
            continue
        cache_dir = Path(config.dpo.reference_cache_dir) if config.dpo.reference_cache_dir else \
            default_cache_dir(path, config.output_dir)
        result = reference_logps(spec, data.pairs, pad_id, path, cache_dir, desc=f"reference log-probs {path}")
        say(f"reference log-probs for {len(data.pairs)} pairs of {path}: "
            f"{'reused' if result.reused else 'computed and cached'} {result.path}")
        sources.append(ReferenceSource(table=(result.chosen, result.rejected)))
    return sources[0], sources[1]


def _write_outputs(run: Run, data: PairData, units: list[TokenizedPair], train_ref: ReferenceSource) -> None:
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


def _write_eval(run: Run, step: int, before: dict, after: dict) -> None:
    if not dist.is_main():
        return
    (run.output_dir / "eval.json").write_text(json.dumps({"before": before, "after": after}, indent=1))
    with open(run.output_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
        for phase, values in (("before_training", before), ("after_training", after)):
            handle.write(json.dumps({"step": step, "eval_phase": phase,
                                     **{f"eval/{k}": v for k, v in values.items()}}) + "\n")
    say("held-out: " + "; ".join(
        f"{k} {before[k]:.3f} → {after[k]:.3f}" for k in ("loss", "rewards/accuracy", "logps_accuracy")))


def run_dpo(config: DPORecipe) -> int:
    run = start_run(config)
    try:
        tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
        pad_id = tokenizer.pad_token_id
        train_data = read_pairs(config, config.data.train, tokenizer, "")
        eval_data = read_pairs(config, config.data.eval, tokenizer, "-eval") if config.data.eval else None
        # The reference pass runs (and frees its model) before the policy is loaded: peak memory is one model.
        train_ref, eval_ref = prepare_reference(config, run, train_data, eval_data, pad_id)
        lm = load_model(config.model.path, config.model.dtype, config.model.attn_implementation,
                        config.model.trust_remote_code)
        lm.config.use_cache = False
        root = PairLogprobModel(lm, chunk_size=config.train.loss_chunk_size)
        lean_mlp(lm)
        parallelize_root(config, root, lm)
        units = build_units(config, train_data.pairs, dist.world_size())
        per_step = config.train.batch_size * config.train.grad_accum * dist.world_size()
        leftover = len(units) % per_step
        say(f"{len(units)} pairs → {len(units) // per_step} steps of {per_step}"
            + (f"; the last {leftover} do not fill a step and are not used" if leftover else ""))
        _write_outputs(run, train_data, units, train_ref)
        before = evaluate_pairs(config, root, eval_data.pairs, pad_id, eval_ref) if eval_data else None
        settings = loop_settings(run, root, lm)
        # BCO's running δ is trainer state: the loop checkpoints ``extra_state`` (this same dict) with each step.
        bco = settings.extra_state
        bco.update(bco_mean=0.0, bco_count=0)
        if _running_bco(config):
            _restore_bco_state(run, bco)
        code = train(root, dpo_objective(config, units, pad_id, train_ref, bco), settings)
        if code == 0:
            if eval_data is not None:
                after = evaluate_pairs(config, root, eval_data.pairs, pad_id, eval_ref, bco["bco_mean"])
                _write_eval(run, len(units) // per_step, before, after)
            export_final(run, root, lm, tokenizer)
        return code
    finally:
        dist.destroy()
