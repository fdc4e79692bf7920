"""``posttrain sft``: supervised fine-tuning with an optional easy-to-hard curriculum.

setup (the model path and the local data files checked before anything is written) → read the data (refused
before the model loads) → model → tokenise → units (curriculum order, optionally packed) → the loop with a
``StreamSource`` and the SFT loss (``posttrain.algorithms.sft``) → held-out loss (``data.eval``) → export.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain import dist
from posttrain.algorithms.sft import sft_loss
from posttrain.config.recipes import SFTRecipe
from posttrain.data.errors import DataError
from posttrain.data.io import read_records
from posttrain.data.packing import PackedRow, collate_packed, collate_padded, pack_examples
from posttrain.data.records import SFTExample
from posttrain.data.tokenize import TokenizedExample, tokenize_records
from posttrain.models.attention import attention_kwargs
from posttrain.models.logprobs import IGNORE_INDEX, TokenLogprobModel, batch_positions
from posttrain.store.run_store import working_dir
from posttrain.train.evaluation import sharded_sums
from posttrain.train.loop import train
from posttrain.train.precision import autocast
from posttrain.train.runner import (
    batch_geometry,
    build_policy,
    export_final,
    finish,
    loop_settings,
    peek_data,
    say,
    start_run,
)
from posttrain.train.source import BatchGeometry, StreamSource
from posttrain.train.stream import Difficulty, build_stream, check_curriculum


def loss_tokens(labels: list[int]) -> int:
    """Tokens that carry loss: labels are predicted from the previous position, so the first never counts."""
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)


def token_count(input_ids: list[int], pad_id: int) -> int:
    return len(input_ids) if pad_id is None else sum(1 for t in input_ids if t != pad_id)


@dataclass
class SFTData:
    examples: list[TokenizedExample]
    dropped: Counter


def _what(config: SFTRecipe, path: str) -> str:
    return "training set" if path == config.data.train else "eval set"


def check_sft_data(config: SFTRecipe) -> None:
    """``start_run``'s data check (``peek_data``), and for a training file read whole the curriculum's refusal. A
    longer file is judged by ``read_sft``, before the model loads."""
    peeks = peek_data(config, "sft")
    if config.data.train in peeks:
        checked_curriculum(config, [Difficulty(r.tier, r.difficulty) for r in peeks[config.data.train].records])


def read_sft(config: SFTRecipe, path: str, quarantine_suffix: str) -> list[SFTExample]:
    """Every SFT record of ``path`` (bad ones quarantined under ``data.on_error: quarantine``); a file with nothing
    usable, or mostly quarantined, stops here (``ReadReport.check_usable``)."""
    quarantine = config.data.quarantine_path or f"{working_dir(config.output_dir, config.store.local_dir)}/quarantine{quarantine_suffix}.jsonl"
    records, report = read_records(
        path, kind="sft", fmt=config.data.format, on_error=config.data.on_error, quarantine_path=quarantine,
        split_across_ranks=True, max_record_bytes=config.data.max_record_bytes,
    )
    say(report.summary())
    report.check_usable(_what(config, path))  # nothing or mostly quarantined
    return records


def tokenize_sft(config: SFTRecipe, path: str, records: list[SFTExample], tokenizer) -> SFTData:
    """Tokenise SFT records; an example left with no trained token is dropped and counted.

    A template that rewrites earlier turns (Qwen3-style) gives one row per such turn
    (``posttrain.data.tokenize``); the count says so.
    """
    rows, tokens = tokenize_records(records, tokenizer, config.train.max_length, config.data.truncation_side,
                                    progress=dist.is_main())
    examples, dropped = [], Counter()
    for example in rows:
        if loss_tokens(example.labels) == 0:
            dropped["no assistant tokens left after truncation"] += 1
            continue
        examples.append(example)
    if not examples:
        raise DataError(path, None, None, f"no example has a trained token left after tokenisation at "
                        f"train.max_length={config.train.max_length} ({dict(dropped)}); raise train.max_length or "
                        f"check data.truncation_side={config.data.truncation_side}")
    extra_rows = tokens.examples - tokens.records
    say(
        f"{path}: {len(examples)} examples tokenized"
        + (f" ({extra_rows} extra rows: the template rewrites earlier turns)" if extra_rows else "")
        + f"; {tokens.truncated} truncated to {config.train.max_length} tokens ({config.data.truncation_side} side)"
        + "".join(f"; dropped {n}: {why}" for why, n in dropped.items())
    )
    return SFTData(examples, dropped)


def checked_curriculum(config, items: list[Difficulty]) -> str | None:
    """``check_curriculum`` on ``data.train``'s items: its refusal as a ``DataError``, else its warning text."""
    try:
        return check_curriculum(config.data.curriculum, items, config.data.train)
    except ValueError as exc:
        raise DataError(config.data.train, None, "tier", str(exc).split(": ", 1)[1]) from None


def curriculum_items(config, items: list[Difficulty]) -> list[Difficulty]:
    """The items, after refusing (or warning about) a curriculum the data carries no tiers for.

    ``tiered`` on data with no ``tier`` at all trains in a seeded shuffle: said in one ``[posttrain] warning:``
    line (the run is as asked, in another order); partly tagged data is a Python warning."""
    warning = checked_curriculum(config, items)
    if warning and config.data.curriculum == "tiered" and all(item.tier is None for item in items):
        say(f"warning: {warning}")
    elif warning:
        warnings.warn(warning, stacklevel=2)
    return items


def build_units(config: SFTRecipe, examples: list[TokenizedExample], pad_id: int) -> list[TokenizedExample | PackedRow]:
    """Order the examples by the curriculum, then (optionally) pack them into rows in that order.

    The order depends on the global batch, never on the number of ranks.
    """
    train = config.train
    items = curriculum_items(config, [Difficulty(e.tier, e.difficulty) for e in examples])
    per_step = train.global_batch

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


def sft_root(config) -> Callable[[torch.nn.Module], TokenLogprobModel]:
    """``build_policy``'s ``wrap`` for the SFT loss (SFT, pretrain): with ``model.liger``, the summed log-prob
    comes from Liger's fused linear cross-entropy instead of the chunked head (``posttrain.models.liger``)."""
    summed_head = None
    if config.model.liger:
        from posttrain.models.liger import liger_summed_logprob as summed_head
    return lambda lm: TokenLogprobModel(lm, config.train.loss_chunk_size, summed_head=summed_head)


def sft_step_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """The loss the loop calls per micro-batch: summed NLL of the loss tokens (the loop normalises)."""
    total, _ = model(batch["input_ids"], batch["labels"], batch.get("attention_mask"), batch.get("position_ids"),
                     segments=attention_kwargs(batch), positions=batch_positions(batch), summed=True)
    return sft_loss(total), {}


def _collate(packing: bool, pad_id: int):
    def collate(units: list) -> dict[str, torch.Tensor]:
        batch = collate_packed(units) if packing else collate_padded(units, pad_id)
        # the segment lengths stay Python ints (max_length_q/_k): the kernel takes them from the host
        return {key: value.to(dist.device()) if torch.is_tensor(value) else value for key, value in batch.items()}

    return collate


def sft_source(name: str, units: list, geometry: BatchGeometry, tiers: dict[str, int | None], pad_id: int,
               packing: bool) -> StreamSource:
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

    return StreamSource(
        name, units, geometry, collate=_collate(packing, pad_id),
        normalizer=lambda batch: sum(loss_tokens(u.labels) for u in batch), rank=dist.rank(),
        describe=describe, token_counts=token_counts, unit_ids=members,
    )


def mean_loss_evaluator(units: list, batch_size: int, pad_id: int, packing: bool, precision: str, sharded: bool):
    """``evaluate(model) -> {"loss": token-mean NLL, "tokens"}`` over held-out units, sharded over ranks."""
    collate = _collate(packing, pad_id)

    def measure(model: torch.nn.Module, chunk: list) -> torch.Tensor:
        with autocast(precision, sharded):
            loss_sum, _ = sft_step_loss(model, collate(chunk))
        return torch.tensor([float(loss_sum), float(sum(loss_tokens(u.labels) for u in chunk))], dtype=torch.float64)

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        total = sharded_sums(model, units, batch_size, measure)
        return {"loss": float(total[0] / max(float(total[1]), 1.0)), "tokens": int(total[1])}

    return evaluate


def run_sft(config: SFTRecipe) -> int:
    run = start_run(config, check_data=check_sft_data)
    try:
        if run.finished:
            return 0
        geometry = batch_geometry(config)
        # The data is read, and refused, before the model loads: a model can take minutes to load.
        records = read_sft(config, config.data.train, "")
        checked_curriculum(config, [Difficulty(r.tier, r.difficulty) for r in records])  # warned once, below
        eval_records = read_sft(config, config.data.eval, "-eval") if config.data.eval else []
        root, lm, tokenizer = build_policy(config, sft_root(config))
        pad_id = tokenizer.pad_token_id
        data = tokenize_sft(config, config.data.train, records, tokenizer)
        del records  # the tokenised examples hold what training needs
        units = build_units(config, data.examples, pad_id)
        eval_examples = tokenize_sft(config, config.data.eval, eval_records, tokenizer).examples if eval_records else []
        eval_units = pack_examples(eval_examples, config.train.max_length, pad_id) if config.data.packing else eval_examples
        leftover = len(units) % geometry.global_batch
        say(
            f"{len(units)} {'packed rows' if config.data.packing else 'examples'} → {len(units) // geometry.global_batch} "
            f"steps of {geometry.global_batch} ({geometry.world} rank(s) × {geometry.grad_accum} micro-batch(es) of "
            f"{geometry.micro_batch})" + (f"; the last {leftover} do not fill a step and are not used" if leftover else "")
        )
        tiers = {e.id: e.tier for e in data.examples}
        source = sft_source("sft", units, geometry, tiers, pad_id, config.data.packing)
        settings = loop_settings(run, lm)
        if eval_units:
            settings.evaluate = mean_loss_evaluator(eval_units, config.train.batch_size, pad_id, config.data.packing,
                                                    config.train.precision, settings.sharded)
        code = train(root, source, sft_step_loss, settings)
        if code == 0:
            finish("sft", run, settings, export_final(run, root, lm, tokenizer))
        return code
    finally:
        dist.destroy()
