"""``posttrain sft``: supervised fine-tuning with an optional easy-to-hard curriculum."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from posttrain import dist
from posttrain.config.recipes import SFTRecipe
from posttrain.data.io import read_records
from posttrain.data.packing import PackedRow, collate_packed, collate_padded, pack_examples
from posttrain.data.tokenize import TokenizedExample, tokenize_chat
from posttrain.models.logprobs import IGNORE_INDEX
from posttrain.train.loop import Objective, train
from posttrain.train.runner import export_final, load_policy, loop_settings, say, start_run
from posttrain.train.stream import Difficulty, build_stream


def loss_tokens(labels: list[int]) -> int:
    """Tokens that carry loss: labels are predicted from the previous position, so the first never counts."""
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


def token_count(input_ids: list[int], pad_id: int) -> int:
    return len(input_ids) if pad_id is None else sum(1 for t in input_ids if t != pad_id)


@dataclass
class SFTData:
    examples: list[TokenizedExample]
    dropped: Counter


def tokenize_sft(config: SFTRecipe, path: str, tokenizer, quarantine_suffix: str) -> SFTData:
    quarantine = config.data.quarantine_path or f"{config.output_dir}/quarantine{quarantine_suffix}.jsonl"
    records, report = read_records(
        path, kind="sft", fmt=config.data.format, on_error=config.data.on_error, quarantine_path=quarantine
    )
    say(report.summary())
    examples, dropped = [], Counter()
    truncated = 0
    for record in tqdm(records, desc=f"tokenize {path}", disable=not dist.is_main(), leave=False):
        example = tokenize_chat(record, tokenizer, config.train.max_length, config.data.truncation_side)
        truncated += example.truncated
        if loss_tokens(example.labels) == 0:
            dropped["no assistant tokens left after truncation"] += 1
            continue
        examples.append(example)
    say(
        f"{path}: {len(examples)} examples tokenized; {truncated} truncated to {config.train.max_length} tokens "
        f"({config.data.truncation_side} side)"
        + "".join(f"; dropped {n}: {why}" for why, n in dropped.items())
    )
    return SFTData(examples, dropped)


def build_units(config: SFTRecipe, examples: list[TokenizedExample], world: int, pad_id: int) -> list[TokenizedExample | PackedRow]:
    """Order the examples by the curriculum, then (optionally) pack them into rows in that order."""
    train = config.train
    items = [Difficulty(e.tier, e.difficulty) for e in examples]
    per_step = train.batch_size * train.grad_accum * world

    def stream(epochs: float | None, max_steps: int | None, stretch: int = 1):
        # ``stretch`` counts draws in examples when a step holds ``stretch`` examples per row (packing).
        pace = config.data.competence_steps or (max_steps // 2 if max_steps else None)
        return build_stream(
            items,
            config.data.curriculum,
            train.seed,
            epochs,
            per_step,
            max_steps * stretch if max_steps else None,
            config.data.competence_start,
            pace * stretch if pace else None,
            config.data.shuffle,
        )

    if not config.data.packing:
        return [examples[i] for i in stream(train.epochs, train.max_steps)]
    if train.max_steps is None:
        return pack_examples([examples[i] for i in stream(train.epochs, None)], train.max_length, pad_id)
    wanted = train.max_steps * per_step
    if config.data.curriculum == "competence":
        # Draw enough examples to fill max_steps of packed rows; the pacing stretches with them, so
        # row-step t sees the competence of example-step ≈ t × examples-per-row.
        mean_length = sum(len(e) for e in examples) / len(examples)
        stretch = max(1, math.ceil(train.max_length / mean_length))
        while True:
            rows = pack_examples([examples[i] for i in stream(None, train.max_steps, stretch)], train.max_length, pad_id)
            if len(rows) >= wanted:
                return rows[:wanted]
            stretch += 1
    epochs = 1.0  # packed rows hold several examples: add epochs until max_steps worth of rows exist
    while True:
        rows = pack_examples([examples[i] for i in stream(epochs, None)], train.max_length, pad_id)
        if len(rows) >= wanted:
            return rows[:wanted]
        epochs += 1.0


def sft_objective(
    units: list, eval_units: list, tiers: dict[str, int | None], pad_id: int, packing: bool
) -> Objective:
    def collate(batch: list) -> dict[str, torch.Tensor]:
        return collate_packed(batch) if packing else collate_padded(batch, pad_id)

    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
        logprobs, _ = model(
            batch["input_ids"], batch["labels"], batch.get("attention_mask"), batch.get("position_ids")
        )
        return -logprobs.sum(), {}

    def members(unit) -> list[str]:
        return unit.example_ids if packing else [unit.id]

    def describe(batch: list) -> dict[str, int]:
        drawn = Counter(tiers.get(i) for unit in batch for i in members(unit))
        return {f"tier_{t if t is not None else 'none'}": n for t, n in sorted(drawn.items(), key=lambda kv: str(kv[0]))}

    def token_counts(batch: list) -> tuple[int, int]:
        return (
            sum(token_count(u.input_ids, pad_id) for u in batch),
            sum(loss_tokens(u.labels) for u in batch),
        )

    return Objective(
        name="sft",
        units=units,
        collate=collate,
        normalizer=lambda batch: sum(loss_tokens(u.labels) for u in batch),
        loss=loss,
        describe=describe,
        token_counts=token_counts,
        eval_units=eval_units,
    )


def run_sft(config: SFTRecipe) -> int:
    run = start_run(config)
    try:
        root, lm, tokenizer = load_policy(config)
        data = tokenize_sft(config, config.data.train, tokenizer, "")
        units = build_units(config, data.examples, dist.world_size(), tokenizer.pad_token_id)
        eval_examples = tokenize_sft(config, config.data.eval, tokenizer, "-eval").examples if config.data.eval else []
        eval_units = pack_examples(eval_examples, config.train.max_length, tokenizer.pad_token_id) if config.data.packing else eval_examples
        per_step = config.train.batch_size * config.train.grad_accum * dist.world_size()
        leftover = len(units) % per_step
        say(
            f"{len(units)} {'packed rows' if config.data.packing else 'examples'} → {len(units) // per_step} steps "
            f"of {per_step}" + (f"; the last {leftover} do not fill a step and are not used" if leftover else "")
        )
        tiers = {e.id: e.tier for e in data.examples}
        objective = sft_objective(units, eval_units, tiers, tokenizer.pad_token_id, config.data.packing)
        code = train(root, objective, loop_settings(run, root, lm))
        if code == 0:
            export_final(run, root, lm, tokenizer)
        return code
    finally:
        dist.destroy()
