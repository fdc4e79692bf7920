"""``posttrain data tasks``: write the built-in verifiable tasks (``posttrain.tasks``) as a data file.

The embedded default's problems, with answer keys and verifiers, in the three tiers: RL prompts for
``posttrain grpo`` / ``posttrain sample``, SFT examples, or eval items. Train and eval splits never share
a problem (``posttrain.tasks``).
"""

from __future__ import annotations

import argparse
import sys

KINDS = ("rl", "sft", "eval")


def add_parser(sub: argparse._SubParsersAction) -> None:
    tasks = sub.add_parser(
        "tasks",
        help="Write the built-in verifiable tasks (RL prompts, SFT examples or eval items) as JSONL.",
        description="Write N built-in problems (reasoning, instruction following, transformation; tiers 1-3) "
        "with their answer keys and verifiers to OUT as JSONL: `rl` prompts for posttrain grpo / sample, `sft` "
        "examples, or `eval` items (the eval split, never trained on).",
    )
    tasks.add_argument("kind", choices=KINDS, help="what to write")
    tasks.add_argument("out", help="output .jsonl (or .parquet for rl/sft) path, or an object-store URL "
                       "(s3://bucket/key.jsonl; written in full or not at all)")
    tasks.add_argument("-n", type=int, default=512, help="number of records (eval: items per group × tier cell "
                       "is n // 9, at least 1; default 512)")
    tasks.add_argument("--seed", type=int, default=0, help="seed of the problem generators (default 0)")
    tasks.add_argument("--held-out", action="store_true", help="rl only: prompts from the eval split, never trained "
                       "on (a GRPO recipe's data.eval, e.g. with --group tool_use)")
    tasks.add_argument("--group", action="append", dest="groups", metavar="GROUP",
                       help="only this capability group (reasoning, instruction_following, transformation, or "
                       "tool_use: large-number arithmetic and counting for a Python tool, never in the default); "
                       "repeat for several (default: the first three; rl and sft only)")
    tasks.add_argument("--tier", action="append", dest="tiers", type=int, choices=(1, 2, 3),
                       help="only this tier; repeat for several (default: all; rl and sft only)")
    tasks.set_defaults(func=_write_tasks)


def _write_tasks(args: argparse.Namespace) -> int:
    from posttrain.data.io import write_jsonl, write_records
    from posttrain.tasks.emit import flywheel_suite, rl_prompts, sft_examples
    from posttrain.tasks.problem import ALL_GROUPS

    unknown = [g for g in args.groups or () if g not in ALL_GROUPS]
    if args.n < 1 or unknown:
        problem = f"-n must be >= 1 (got {args.n})" if args.n < 1 else f"unknown --group {unknown[0]!r}"
        print(f"posttrain data tasks: {problem}; groups are {', '.join(ALL_GROUPS)}", file=sys.stderr)
        return 2
    out = args.out  # a local path or a URL: the writers create parent directories and write atomically
    if args.kind == "eval":
        items = flywheel_suite(n_per_cell=max(1, args.n // 9), seed=args.seed).items
        write_jsonl(str(out), [item.model_dump(mode="json") for item in items])
        count = len(items)
    else:
        split = {"split": "eval"} if args.held_out and args.kind == "rl" else {}
        records = (rl_prompts if args.kind == "rl" else sft_examples)(args.n, args.seed, groups=args.groups,
                                                                       tiers=args.tiers, **split)
        write_records(str(out), records)
        count = len(records)
    print(f"[posttrain] wrote {count} {args.kind} records to {out}", file=sys.stderr)
    return 0
