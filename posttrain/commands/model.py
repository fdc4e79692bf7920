"""``posttrain model tiny DIR``: build a tiny Llama model and tokenizer (no hub needed)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="Model utilities (build a tiny model for tests and demos).")
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    tiny = sub.add_parser(
        "tiny",
        help="Build a small Llama model with seeded random weights and a BPE tokenizer, in HF format.",
    )
    tiny.add_argument("output_dir")
    tiny.add_argument("--texts", help="text or JSONL file to train the tokenizer on (default: a built-in sample)")
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny)


def _tiny(args: argparse.Namespace) -> int:
    from posttrain.models.tiny import DEFAULT_TEXTS, build_tiny_model  # torch + transformers: not for --help

    texts = DEFAULT_TEXTS
    if args.texts:
        texts = Path(args.texts).read_text(encoding="utf-8").splitlines()
    path = build_tiny_model(
        args.output_dir,
        texts=texts,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        seed=args.seed,
    )
    print(f"tiny model written to {path}")
    return 0
