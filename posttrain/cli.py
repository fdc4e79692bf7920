"""The ``posttrain`` command line: one entry point, one subcommand per recipe or tool.

Recipe subcommands (``sft``, ``dpo``, …) all take ``--config FILE`` plus dotted ``key=value``
overrides and come from the recipe registry. Tool subcommands (``data inspect``, ``generate``,
``eval``, …) live next to their code; each module in ``_COMMAND_MODULES`` exposes
``register(subparsers)`` and sets ``func`` on its parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from posttrain import __version__
from posttrain.config import ConfigError, load_config
from posttrain.config.registry import RECIPES, load_builtin_recipes, run_recipe
from posttrain.exit_codes import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_RESUMABLE

_COMMAND_MODULES = (
    "posttrain.commands.validate",
    "posttrain.data.inspect",
    "posttrain.commands.model",
    "posttrain.commands.quickstart",
    "posttrain.generate.cli",
    "posttrain.eval.cli",
)

EPILOG = f"""\
exit codes: {EXIT_OK} ok, {EXIT_FAILED} failed, {EXIT_BAD_CONFIG} bad config or input,
            {EXIT_RESUMABLE} preempted after saving a checkpoint (rerun the same command to resume)
"""


def _add_recipe_commands(subparsers: argparse._SubParsersAction) -> None:
    load_builtin_recipes()
    for name, spec in RECIPES.items():
        parser = subparsers.add_parser(
            name,
            help=spec.summary,
            description=f"{spec.summary}\n\nRun the `{name}` recipe: posttrain {name} --config FILE [key=value ...]",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument("--config", help="YAML recipe; may be omitted when overrides give every required key")
        parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=3e-4")
        parser.set_defaults(func=_run_recipe_command, recipe_name=name)


def _run_recipe_command(args: argparse.Namespace) -> int:
    name = args.recipe_name
    overrides = [*args.overrides, f"recipe={name}"]
    config = load_config(RECIPES[name].schema, args.config, overrides)
    return run_recipe(name, config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-training for causal LMs: curate, SFT with a curriculum, DPO-family alignment, eval.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    _add_recipe_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_CONFIG
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"posttrain: invalid config\n{exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (FileNotFoundError, ValueError) as exc:
        from posttrain.data.errors import DataError

        if isinstance(exc, DataError | FileNotFoundError):
            print(f"posttrain: {exc}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        raise
