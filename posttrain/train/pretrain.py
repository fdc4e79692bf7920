"""``posttrain pretrain``: next-token training on plain text, e.g. to make the demo's base model.

Every token of a document carries loss (no chat template, no masks). Documents are wrapped as
``BOS text EOS`` and packed into ``train.max_length`` rows with per-document position ids.
"""

from __future__ import annotations

from pathlib import Path

from posttrain import dist
from posttrain.config.recipes import PretrainRecipe
from posttrain.data.errors import DataError
from posttrain.data.io import iter_jsonl, iter_text_lines
from posttrain.data.lines import MAX_RECORD_BYTES
from posttrain.data.packing import pack_examples
from posttrain.data.records import stable_id
from posttrain.data.shards import read_shards
from posttrain.data.storage import storage_errors
from posttrain.data.tokenize import TokenizedExample
from posttrain.train.loop import train
from posttrain.train.runner import (
    batch_geometry,
    build_policy,
    export_final,
    finish,
    loop_settings,
    say,
    start_run,
)
from posttrain.train.sft import build_units, mean_loss_evaluator, sft_root, sft_source, sft_step_loss


def _read_text_file(path: str, max_record_bytes: int) -> list[str]:
    texts = []
    if path.removesuffix(".gz").endswith((".jsonl", ".json")):
        for line_no, record in iter_jsonl(path, max_record_bytes):
            if not isinstance(record.get("text"), str):
                raise DataError(path, line_no, "text", "expected a string field `text`")
            texts.append(record["text"])
    else:
        texts.extend(line for _, line in iter_text_lines(path, max_record_bytes))
    return texts


def read_texts(path: str, max_record_bytes: int = MAX_RECORD_BYTES) -> list[str]:
    """Documents from .txt files (one per non-empty line) or JSONL/JSON lines with a ``text`` field: one file
    or a shard set (``posttrain.data.shards``), local or ``s3://…``, each rank reading its share of the shards.
    A line of more than ``max_record_bytes`` stops the read with ``DataError`` naming it."""
    with storage_errors(path):
        parts = read_shards(path, lambda shard: _read_text_file(shard, max_record_bytes), split_across_ranks=True)
        texts = [text for _, part in parts for text in part]
    if not texts:
        raise DataError(path, None, None, "no documents")
    return texts


def tokenize_text(text: str, tokenizer, max_length: int) -> TokenizedExample:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
    truncated = len(ids) > max_length
    ids = ids[:max_length]
    return TokenizedExample(
        input_ids=ids, labels=list(ids), truncated=truncated, id=stable_id(text, "doc-"), tier=None, difficulty=None
    )


def run_pretrain(config: PretrainRecipe) -> int:
    run = start_run(config)
    try:
        if run.finished:
            return 0
        geometry = batch_geometry(config)
        root, lm, tokenizer = build_policy(config, sft_root(config))
        pad_id = tokenizer.pad_token_id
        texts = read_texts(config.data.train, config.data.max_record_bytes)
        examples = [tokenize_text(t, tokenizer, config.train.max_length) for t in texts]
        say(f"{config.data.train}: {len(examples)} documents; {sum(e.truncated for e in examples)} truncated")
        units = build_units(config, examples, pad_id)
        source = sft_source("pretrain", units, geometry, {}, pad_id, packing=True)
        settings = loop_settings(run, lm)
        if config.data.eval:
            eval_texts = read_texts(config.data.eval, config.data.max_record_bytes)
            eval_examples = [tokenize_text(t, tokenizer, config.train.max_length) for t in eval_texts]
            eval_units = pack_examples(eval_examples, config.train.max_length, pad_id)
            settings.evaluate = mean_loss_evaluator(eval_units, config.train.batch_size, pad_id, True,
                                                    config.train.precision, settings.sharded)
        code = train(root, source, sft_step_loss, settings)
        if code == 0:
            final = export_final(run, root, lm, tokenizer)
            if dist.is_main():
                Path(final / "PRETRAINED_ON.txt").write_text(f"{config.data.train}\n")
            finish("pretrain", run, settings, final)
        return code
    finally:
        dist.destroy()
