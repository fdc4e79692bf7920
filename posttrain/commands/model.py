"""``posttrain model tiny DIR``: build a tiny Llama model and tokenizer (no hub needed); ``--arch qwen3_moe`` or
``deepseek_v3`` a tiny mixture of experts (docs/moe.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="Model utilities (build a tiny model for tests and demos).")
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    tiny = sub.add_parser(
        "tiny",
        help="Build a small Llama model (or, with --arch, a mixture of experts) with seeded random weights and a "
        "BPE tokenizer, in HF format.",
    )
    tiny.add_argument("output_dir")
    tiny.add_argument("--texts", help="text or JSONL file to train the tokenizer on (default: a built-in sample)")
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--arch", choices=("llama", "qwen3_moe", "deepseek_v3"), default="llama",
                      help="llama (dense, the default); qwen3_moe or deepseek_v3: a mixture of experts (docs/moe.md)")
    tiny.add_argument("--experts", type=int, default=8, help="MoE: routed experts per MoE layer (default 8)")
    tiny.add_argument("--experts-per-token", type=int, default=2, help="MoE: experts each token is routed to (top-K)")
    tiny.add_argument("--shared-experts", type=int, default=None,
                      help="MoE: always-on experts per layer (deepseek_v3 only; default 1 there)")
    tiny.set_defaults(func=_tiny)


def _tiny(args: argparse.Namespace) -> int:
    from posttrain.models.tiny import DEFAULT_TEXTS, build_tiny_model  # torch + transformers: not for --help

    problem = _shape_problem(args.hidden_size, args.heads, args.kv_heads)
    if problem:
        print(f"posttrain model tiny: {problem}", file=sys.stderr)
        return 2
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
        **_moe_arguments(args),
    )
    print(f"tiny model written to {path}")
    return 0


def _shape_problem(hidden: int, heads: int, kv_heads: int) -> str | None:
    """What is wrong with an attention shape, said before transformers says it in its own words (or None)."""
    if min(hidden, heads, kv_heads) < 1:
        return "--hidden-size, --heads and --kv-heads must be positive"
    if hidden % heads:
        fits = [h for h in range(1, hidden + 1) if hidden % h == 0 and h % kv_heads == 0 and h <= 64]
        return (f"--hidden-size {hidden} does not split into {heads} heads (head size = hidden / heads); "
                f"heads that fit with --kv-heads {kv_heads}: {', '.join(map(str, fits)) or 'none'}")
    if heads % kv_heads:
        return f"--heads {heads} is not a multiple of --kv-heads {kv_heads} (each key/value head serves a group)"
    return None


def _moe_arguments(args: argparse.Namespace) -> dict:
    """The MoE shape for ``build_tiny_model``; MoE flags on a dense model are refused, not ignored."""
    if args.arch == "llama":
        given = [flag for flag, value, default in (("--experts", args.experts, 8),
                                                   ("--experts-per-token", args.experts_per_token, 2),
                                                   ("--shared-experts", args.shared_experts, None)) if value != default]
        if given:
            from posttrain.models.moe import MoeConfigError

            raise MoeConfigError(f"{', '.join(given)} shape(s) a mixture of experts; add --arch qwen3_moe or --arch "
                                 "deepseek_v3")
        return {}
    shared = args.shared_experts if args.shared_experts is not None else (1 if args.arch == "deepseek_v3" else 0)
    return {"arch": args.arch, "experts": args.experts, "experts_per_token": args.experts_per_token,
            "shared_experts": shared}
