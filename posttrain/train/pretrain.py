"""``posttrain pretrain``: next-token training on plain text, e.g. to make the demo's base model.

Every token of a document carries loss (no chat template, no masks). Documents are wrapped as
``BOS text EOS`` and packed into ``train.max_length`` rows with per-document position ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain import dist
from posttrain.config.recipes import PretrainRecipe
from posttrain.data.errors import DataError
from posttrain.data.packing import pack_examples
from posttrain.data.records import stable_id
from posttrain.data.tokenize import TokenizedExample
from posttrain.train.loop import train
from posttrain.train.runner import export_final, load_policy, loop_settings, say, start_run
from posttrain.train.sft import build_units, sft_objective


def read_texts(path: str) -> list[str]:
    """Documents from a .txt file (one per non-empty line) or JSONL/JSON lines with a ``text`` field."""
    texts = []
    with open(path, encoding="utf-8", errors="strict") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if not path.endswith((".jsonl", ".json")):
                texts.append(line.rstrip("\n"))
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(path, line_no, None, f"malformed JSON: {exc.msg}") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(path, line_no, "text", "expected a string field `text`")
            texts.append(record["text"])
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
        root, lm, tokenizer = load_policy(config)
        texts = read_texts(config.data.train)
        examples = [tokenize_text(t, tokenizer, config.train.max_length) for t in texts]
        say(f"{config.data.train}: {len(examples)} documents; {sum(e.truncated for e in examples)} truncated")
        config.data.packing = True
        units = build_units(config, examples, dist.world_size(), tokenizer.pad_token_id)
        eval_units = []
        if config.data.eval:
            eval_examples = [tokenize_text(t, tokenizer, config.train.max_length) for t in read_texts(config.data.eval)]
            eval_units = pack_examples(eval_examples, config.train.max_length, tokenizer.pad_token_id)
        objective = sft_objective(units, eval_units, {}, tokenizer.pad_token_id, packing=True)
        objective.name = "pretrain"
        code = train(root, objective, loop_settings(run, root, lm))
        if code == 0:
            export_final(run, root, lm, tokenizer)
            Path(run.output_dir / "final" / "PRETRAINED_ON.txt").write_text(f"{config.data.train}\n")
        return code
    finally:
        dist.destroy()
