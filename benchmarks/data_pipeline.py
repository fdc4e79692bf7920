"""Data-layer throughput: read JSONL, read Parquet, tokenise with assistant masks, pack. Prints one JSON line.

    python benchmarks/data_pipeline.py [--records 20000] [--max-length 512]

Uses the built-in sample records (multi-turn arithmetic/string chats) and a tiny BPE tokenizer built on
the fly, so it runs anywhere without downloads. Also reports packing efficiency: the fraction of packed
tokens that are real (non-padding) tokens, against the same for right-padded batches of 8.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from posttrain.data.io import read_records, write_records
from posttrain.data.packing import collate_padded, pack_examples
from posttrain.data.samples import sample_sft_records
from posttrain.data.tokenize import tokenize_records
from posttrain.models.load import load_tokenizer
from posttrain.models.tiny import build_tiny_model


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8, help="padded batch size for the efficiency baseline")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        records = sample_sft_records(args.records, seed=0)
        texts = [m.content for r in records[:500] for m in r.messages]
        tokenizer = load_tokenizer(str(build_tiny_model(Path(tmp) / "model", texts=texts, vocab_size=1000)))
        jsonl, parquet = str(Path(tmp) / "d.jsonl"), str(Path(tmp) / "d.parquet")
        write_records(jsonl, records)
        write_records(parquet, records)

        (read_jsonl, report), jsonl_s = timed(lambda: read_records(jsonl, kind="sft", progress=False))
        (read_parquet, _), parquet_s = timed(lambda: read_records(parquet, kind="sft", progress=False))
        assert len(read_jsonl) == len(read_parquet) == args.records == report.accepted
        (examples, tok_report), tokenize_s = timed(
            lambda: tokenize_records(read_jsonl, tokenizer, args.max_length, progress=False)
        )
        rows, pack_s = timed(lambda: pack_examples(examples, args.max_length, tokenizer.pad_token_id))

    real_tokens = sum(len(e) for e in examples)
    padded_slots = 0
    for start in range(0, len(examples), args.batch_size):
        batch = collate_padded(examples[start : start + args.batch_size], tokenizer.pad_token_id)
        padded_slots += batch["input_ids"].numel()
    figures = {
        "benchmark": "data_pipeline",
        "records": args.records,
        "max_length": args.max_length,
        "read_jsonl_records_per_s": round(args.records / jsonl_s),
        "read_parquet_records_per_s": round(args.records / parquet_s),
        "tokenize_examples_per_s": round(args.records / tokenize_s),
        "tokenize_tokens_per_s": round(real_tokens / tokenize_s),
        "pack_examples_per_s": round(args.records / pack_s),
        "mean_tokens_per_example": round(real_tokens / args.records, 1),
        "truncated": tok_report.truncated,
        "packed_rows": len(rows),
        "packing_efficiency": round(real_tokens / (len(rows) * args.max_length), 4),
        "padded_batch_efficiency": round(real_tokens / padded_slots, 4),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
