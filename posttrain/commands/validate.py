"""``posttrain validate --config FILE_OR_NAME [key=value ...]``: check a recipe without running it."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="Check a YAML recipe (unknown keys, types, cross-field rules) and exit non-zero on problems.",
        description="Validate a recipe: its top-level `recipe:` key picks the schema. Prints the resolved "
        "config on success; on failure lists every problem with file:line, key and the fix.",
    )
    parser.add_argument("--config", required=True,
                        help="YAML recipe: a file, or a packaged recipe's name (see `posttrain recipes list`)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")
    parser.set_defaults(func=_validate)


def _validate(args: argparse.Namespace) -> int:
    import yaml

    from posttrain.config import resolve_recipe

    name, config = resolve_recipe(args.config, args.overrides)
    if not args.quiet:
        print(f"{args.config}: valid `{name}` recipe")
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False).rstrip())
    return 0
