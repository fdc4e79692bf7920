"""``posttrain recipes list`` and ``posttrain recipes copy NAME [DEST]``: the recipes shipped in the package.

A recipe name works wherever a recipe file does (``--config sft_tiny``); copy one out to edit it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

COMMENT_CHARS = 80  # of a recipe's first comment line in the listing; the file has the rest


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "recipes",
        help="List the recipes shipped with posttrain, or copy one out to edit (`--config NAME` runs one as is).",
        description=__doc__.split("\n", 2)[2] if __doc__ else None,
    )
    sub = parser.add_subparsers(dest="recipes_command", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="Name, kind (its `recipe:` key) and first comment line of each recipe.")
    listing.add_argument("--paths", action="store_true", help="also print where each file is installed")
    listing.set_defaults(func=_list)
    copy = sub.add_parser("copy", help="Copy a packaged recipe to DEST (default: ./NAME.yaml) to edit it.")
    copy.add_argument("name", help="a packaged recipe's name, e.g. sft_tiny (see `posttrain recipes list`)")
    copy.add_argument("dest", nargs="?", help="file or existing directory (default: ./NAME.yaml)")
    copy.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    copy.set_defaults(func=_copy)


def _summary(path: Path) -> tuple[str, str]:
    """(kind, first comment line) of a recipe file, read without a YAML parse: the listing stays instant."""
    kind, comment = "?", ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#") and not comment:
            comment = line.lstrip("#").strip()
        elif line.startswith("recipe:"):
            kind = line.partition(":")[2].split("#")[0].strip()
            break
    return kind, comment


def _list(args: argparse.Namespace) -> int:
    from posttrain.recipes import packaged_recipes

    recipes = packaged_recipes()
    width = max(len(name) for name in recipes)
    for name, path in recipes.items():
        kind, comment = _summary(path)
        if len(comment) > COMMENT_CHARS:
            comment = comment[: COMMENT_CHARS - 1] + "…"
        print(f"{name:<{width}}  {kind:<9} {comment}")
        if args.paths:
            print(f"{'':<{width}}  {path}")
    print("\nrun one as is: posttrain <kind> --config NAME [key=value ...]; copy one: posttrain recipes copy NAME")
    return 0


def _copy(args: argparse.Namespace) -> int:
    from posttrain.recipes import find_recipe, packaged_name

    name = packaged_name(args.name)
    if name is None:
        find_recipe(args.name)  # raises FileNotFoundError naming the closest packaged recipe (exit 2)
        print(f"posttrain recipes copy: {args.name} is a file, not a packaged recipe name", file=sys.stderr)
        return 2
    source = find_recipe(name)
    dest = Path(args.dest) if args.dest else Path(source.name)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not args.force:
        print(f"posttrain recipes copy: {dest} exists; pass --force to overwrite it", file=sys.stderr)
        return 2
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    print(f"copied {name} -> {dest}")
    return 0
