"""``posttrain rm``: a Bradley–Terry reward model — the LM with a scalar head on the last token.

setup → train → evaluate → export, on the shared loop:

1. read and tokenise preference pairs as ``posttrain dpo`` does; without ``data.eval``, a fixed
   fraction of them (chosen by a hash of the pair id, so the split never changes) is held out;
2. the model is ``AutoModelForSequenceClassification`` with ``num_labels=1`` (for Llama:
   ``LlamaForSequenceClassification``; the score head starts from a seeded random init) and
   ``pad_token_id`` set in its config; the reward of a sequence is the head applied to the final hidden
   state of its last token (the end of the assistant turn);
3. the loss is ``posttrain.algorithms.reward.bradley_terry_loss`` per pair, chosen and rejected in one
   forward (one row per pair with the shared prompt, as in DPO);
4. held-out pairwise accuracy before and after training (``eval.json``, and in ``metrics.jsonl``);
5. export to ``output_dir/final`` in HF format (loadable by ``AutoModelForSequenceClassification``), plus
   ``posttrain_reward.json`` with the tokenisation settings that the scorer
   (``posttrain.train.reward_scorer.RewardScorer``) reuses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification

from posttrain import dist
from posttrain.algorithms.reward import bradley_terry_loss
from posttrain.config.preference import RewardModelRecipe
from posttrain.data.errors import DataError
from posttrain.models.attention import attention_for, transformers_name
from posttrain.models.load import DTYPES, load_tokenizer, model_source
from posttrain.progress import quiet_hf_progress
from posttrain.train.dpo import write_eval
from posttrain.train.evaluation import chunk_sums, sharded_sums
from posttrain.train.loop import train
from posttrain.train.pairs import (
    MODEL_KEYS,
    PairData,
    TokenizedPair,
    collate_pairs,
    decoder_hidden,
    pair_summary,
    read_pairs,
    split_pairs,
    write_jsonl,
)
from posttrain.train.precision import autocast
from posttrain.train.reward_scorer import SCORER_SETTINGS
from posttrain.train.runner import (
    base_quantization,
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
from posttrain.train.source import BatchGeometry, StreamSource
from posttrain.train.stream import Difficulty, build_stream


class RewardModel(torch.nn.Module):
    """Root module: ``.lm`` is the HF sequence-classification model; ``forward`` returns one reward per sequence.

    The reward is read at ``last_index`` (flat indices into ``[rows × length]``) rather than where HF looks
    for the last non-pad token, so it is right whatever the pad token is (even when pad = eos) and works
    for the one-row-per-pair layout.
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        if not isinstance(getattr(lm, "score", None), torch.nn.Module):
            raise TypeError(f"{type(lm).__name__} has no `score` head; posttrain reward models need one "
                            "(AutoModelForSequenceClassification of a decoder LM, e.g. Llama, Mistral, Qwen)")

    def forward(self, input_ids, position_ids, attention_mask, last_index) -> torch.Tensor:
        hidden = decoder_hidden(self.lm, input_ids, attention_mask, position_ids)
        last = hidden.reshape(-1, hidden.shape[-1]).index_select(0, last_index)
        return self.lm.score(last).squeeze(-1).float()


def reward_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    device = dist.device()
    return {key: batch[key].to(device) for key in (*MODEL_KEYS, "last_index")}


class _HeldLoadReport(logging.Filter):
    """Holds back transformers' "LOAD REPORT" (a table of checkpoint keys the model did not expect or did not
    find, under an ANSI-bold title even in a log) while a reward model loads: ``load_reward_lm`` decides."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.held.append(record)
            return False
        return True


def _said_load_report(path: str, info: dict[str, Any], held: list[logging.LogRecord]) -> None:
    """A causal LM loaded as a reward model always lacks the score head and has an LM head to spare: one
    plain line says so. Any other difference is transformers' own report, passed on (without ANSI codes
    when stderr is not a terminal)."""
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    expected = (all(key.startswith("score.") for key in missing) and all(key.startswith("lm_head.") for key in unexpected)
                and not info.get("mismatched_keys") and not info.get("error_msgs"))
    if expected:
        if missing:
            unused = f"; the checkpoint's {', '.join(unexpected)} is not used" if unexpected else ""
            say(f"reward model from {path}: a new score head ({', '.join(missing)}, seeded random init){unused}")
        return
    _pass_on(held)


def _pass_on(held: list[logging.LogRecord]) -> None:
    plain = not sys.stderr.isatty()
    for record in held:
        if plain:
            record.msg, record.args = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()), None
        logging.getLogger(record.name).handle(record)


def load_reward_lm(path: str, dtype: str, attn_implementation: str, trust_remote_code: bool, pad_token_id: int,
                   device: torch.device | str = "cpu", quantization_config=None) -> torch.nn.Module:
    placed = {} if quantization_config is None else {"quantization_config": quantization_config,
                                                     "device_map": {"": torch.device(device)}}
    quiet_hf_progress()  # no carriage-return "Loading weights" bar in a log
    report = _HeldLoadReport()
    loader_log = logging.getLogger("transformers.modeling_utils")
    loader_log.addFilter(report)
    try:
        with model_source(path):
            lm, info = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=DTYPES[dtype], attn_implementation=transformers_name(attn_implementation),
                trust_remote_code=trust_remote_code, output_loading_info=True, **placed,
            )
    except BaseException:
        loader_log.removeFilter(report)
        _pass_on(report.held)  # transformers raises after its report (mismatched shapes…): the report is the why
        raise
    loader_log.removeFilter(report)
    _said_load_report(path, info, report.held)
    # HF's own forward finds the last token through pad_token_id: without it, batched scoring refuses to run.
    lm.config.pad_token_id = pad_token_id
    lm.config.use_cache = False
    return lm if quantization_config is not None else lm.to(device)


def holdout_split(pairs: list[TokenizedPair], fraction: float) -> tuple[list[TokenizedPair], list[TokenizedPair]]:
    """``(train, held_out)``: a pair is held out when a hash of its id falls below ``fraction`` (stable split)."""
    def bucket(pair_id: str) -> float:
        return int(hashlib.sha256(pair_id.encode()).hexdigest()[:8], 16) / 2**32

    held = [p for p in pairs if bucket(p.id) < fraction]
    kept = [p for p in pairs if bucket(p.id) >= fraction]
    return kept, held


def _check_scores(data: PairData, path: str) -> None:
    missing = [p.id for p in data.pairs if p.chosen_score is None or p.rejected_score is None]
    if missing:
        raise DataError(path, None, None, f"rm.score_margin needs chosen_score and rejected_score on every pair; "
                        f"{len(missing)} pair(s) lack them (first: {missing[:3]}); set rm.score_margin=false")


def _margins(pairs: list[TokenizedPair], enabled: bool) -> torch.Tensor | None:
    if not enabled:
        return None
    return torch.tensor([p.chosen_score - p.rejected_score for p in pairs], dtype=torch.float32)


def rm_loss(config: RewardModelRecipe):
    """The loss the loop calls per micro-batch: summed Bradley–Terry loss and metric sums over the pairs."""

    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        chosen, rejected = split_pairs(model(**reward_inputs(batch)))
        margin = batch.get("margin")
        per_pair = bradley_terry_loss(chosen, rejected, None if margin is None else margin.to(chosen.device))
        with torch.no_grad():
            metrics = {
                "rewards/chosen": chosen.sum(),
                "rewards/rejected": rejected.sum(),
                "rewards/margin": (chosen - rejected).sum(),
                "accuracy": (chosen > rejected).sum(),
            }
        return per_pair.sum(), metrics

    return loss


def rm_source(config: RewardModelRecipe, units: list[TokenizedPair], geometry: BatchGeometry, pad_id: int
              ) -> StreamSource:
    prefix_sharing = config.rm.prefix_sharing

    def collate(pairs: list[TokenizedPair]) -> dict[str, Any]:
        batch = collate_pairs(pairs, pad_id, prefix_sharing)
        margin = _margins(pairs, config.rm.score_margin)
        if margin is not None:
            batch["margin"] = margin
        return batch

    def token_counts(pairs: list[TokenizedPair]) -> tuple[int, int]:
        tokens = sum(p.row_tokens(prefix_sharing) for p in pairs)
        return tokens, 2 * len(pairs)  # one scored position per sequence

    return StreamSource("rm", units, geometry, collate=collate, normalizer=len, rank=dist.rank(),
                        token_counts=token_counts, unit_ids=lambda pair: [pair.id])


def reward_evaluator(config: RewardModelRecipe, pairs: list[TokenizedPair], pad_id: int, sharded: bool):
    """``evaluate(model)``: held-out Bradley–Terry loss and pairwise accuracy (ties count as wrong)."""

    def measure(model: torch.nn.Module, chunk: list[TokenizedPair]) -> torch.Tensor:
        batch = collate_pairs(chunk, pad_id, config.rm.prefix_sharing)
        with autocast(config.train.precision, sharded):
            chosen, rejected = split_pairs(model(**reward_inputs(batch)))
        margin = _margins(chunk, config.rm.score_margin)
        loss = bradley_terry_loss(chosen, rejected, None if margin is None else margin.to(chosen.device))
        return chunk_sums(loss.sum(), (chosen > rejected).sum(), (chosen - rejected).sum(), count=chosen.shape[0])

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        totals = sharded_sums(model, pairs, config.train.batch_size, measure)
        count = max(float(totals[3]), 1.0)
        return {"loss": float(totals[0]) / count, "accuracy": float(totals[1]) / count,
                "rewards/margin": float(totals[2]) / count, "pairs": int(totals[3])}

    return evaluate


def run_reward_model(config: RewardModelRecipe) -> int:
    run = start_run(config, check_data=lambda c: peek_data(c, "preference"))  # bad data stops before any run state
    try:
        if run.finished:
            return 0
        geometry = batch_geometry(config)
        tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
        pad_id = tokenizer.pad_token_id
        data = read_pairs(config, config.data.train, tokenizer, "")
        if config.data.eval:
            train_pairs = data.pairs
            held_out = read_pairs(config, config.data.eval, tokenizer, "-eval").pairs
        else:
            train_pairs, held_out = holdout_split(data.pairs, config.rm.holdout_fraction)
            say(f"held out {len(held_out)} of {len(data.pairs)} pairs (rm.holdout_fraction={config.rm.holdout_fraction})")
        if config.rm.score_margin:
            _check_scores(data, config.data.train)
        if not held_out:
            raise DataError(config.data.train, None, None, f"no pair fell in the held-out split "
                            f"(rm.holdout_fraction={config.rm.holdout_fraction} of {len(data.pairs)} pairs): raise "
                            "rm.holdout_fraction or add data.eval")

        def load_lm(config: RewardModelRecipe, tokenizer) -> torch.nn.Module:
            model = config.model
            return load_reward_lm(model.path, model.dtype, attention_for(model, config.train.precision),
                                  model.trust_remote_code,
                                  tokenizer.pad_token_id, quantization_config=base_quantization(config))

        root, lm, tokenizer = build_policy(config, RewardModel, load_lm, lora_task="SEQ_CLS")
        items = curriculum_items(config, [Difficulty(p.tier, p.difficulty) for p in train_pairs])
        order = build_stream(
            items, config.data.curriculum, config.train.seed, config.train.epochs, geometry.global_batch,
            config.train.max_steps, config.data.competence_start, config.data.competence_steps, config.data.shuffle,
        )
        units = [train_pairs[i] for i in order]
        say(f"{len(units)} pairs → {len(units) // geometry.global_batch} steps of {geometry.global_batch}")
        write_jsonl(run.output_dir / "pairs.jsonl",
                    [pair_summary(p, {"split": "train"}) for p in train_pairs]
                    + [pair_summary(p, {"split": "held_out"}) for p in held_out])
        if data.dropped_ids:
            write_jsonl(run.output_dir / "dropped_pairs.jsonl", [{"id": i, "reason": r} for i, r in data.dropped_ids])
        settings = loop_settings(run, lm)
        settings.evaluate = reward_evaluator(config, held_out, pad_id, settings.sharded)
        before = settings.evaluate(root)
        source = rm_source(config, units, geometry, pad_id)
        code = train(root, source, rm_loss(config), settings)
        if code == 0:
            after = settings.summary.evals[-1][1]
            write_eval(run.output_dir, source.total_steps(), before, after, ("accuracy", "loss"))
            final = export_final(run, root, lm, tokenizer, load_lm)
            if dist.is_main():
                scorer_settings = {"max_length": config.train.max_length,
                                   "truncation_side": config.data.truncation_side,
                                   "held_out_accuracy": after["accuracy"]}
                (final / SCORER_SETTINGS).write_text(json.dumps(scorer_settings, indent=1))
            finish("rm", run, settings, final)
        return code
    finally:
        dist.destroy()
