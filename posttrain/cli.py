"""The ``posttrain`` command line: one entry point, one subcommand per recipe or tool.

Recipe subcommands (``sft``, ``dpo``, …) all take ``--config FILE_OR_NAME`` plus dotted ``key=value``
overrides and come from the recipe registry; their ``--help`` lists every config key, generated from the
schema. Tool subcommands (``data inspect``, ``generate``, ``eval``, ``recipes``, …) live next to their
code; each module in ``_COMMAND_MODULES`` exposes ``register(subparsers)`` and sets ``func`` on its parser.

First contact must be fast: building the parser imports only argparse, pydantic, yaml and the config
schemas. torch, transformers, numpy, fsspec… are imported inside the functions that run a command
(``tests/test_cli_imports.py`` fails if ``--help`` or ``validate`` import them).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from posttrain import __version__
from posttrain.exit_codes import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_RESUMABLE

_COMMAND_MODULES = (
    "posttrain.commands.validate",
    "posttrain.commands.recipes",
    "posttrain.data.inspect",
    "posttrain.commands.model",
    "posttrain.commands.quickstart",
    "posttrain.commands.launch",
    "posttrain.generate.cli",
    "posttrain.eval.cli",
)

EPILOG = f"""\
exit codes: {EXIT_OK} ok, {EXIT_FAILED} failed, {EXIT_BAD_CONFIG} bad config or input,
            {EXIT_RESUMABLE} preempted after saving a checkpoint (rerun the same command to resume)
threads:    OMP_NUM_THREADS if set, else every core; OMP_WAIT_POLICY=PASSIVE unless set (see posttrain.threads)
"""

CONFIG_HELP = "YAML recipe: a file, or a packaged recipe's name (see `posttrain recipes list`)"


def _add_recipe_commands(subparsers: argparse._SubParsersAction) -> None:
    from posttrain.config.keys import format_config_keys
    from posttrain.config.registry import RECIPES, load_builtin_recipes

    load_builtin_recipes()
    for name, spec in RECIPES.items():
        parser = subparsers.add_parser(
            name,
            help=spec.summary,
            description=f"{spec.summary}\n\nRun the `{name}` recipe: "
            f"posttrain {name} --config FILE_OR_NAME [key=value ...]",
            epilog=format_config_keys(spec.schema),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument("--config", help=f"{CONFIG_HELP}; may be omitted when overrides give every required key")
        parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=3e-4")
        parser.set_defaults(func=_run_recipe_command, recipe_name=name)


def _run_recipe_command(args: argparse.Namespace) -> int:
    from posttrain.config import load_config
    from posttrain.config.registry import RECIPES, run_recipe

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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"] and argv[1:2] not in (["-h"], ["--help"]):
        # torchrun's own options (--nproc_per_node …) come first: argparse would take them for posttrain's.
        from posttrain.commands.launch import launch

        return launch(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_CONFIG
    from posttrain.threads import configure_threads

    # Every command, before any of them imports torch: OpenMP reads its settings once, when it loads.
    # Commands that never run torch (validate, recipes) only get two environment variables set.
    configure_threads(None)
    from posttrain.config.loader import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"posttrain: invalid config\n{exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except OSError as exc:
        from posttrain.train.checkpoint import DiskFullError

        if isinstance(exc, DiskFullError):
            print(f"posttrain: {exc.strerror}", file=sys.stderr)
            return EXIT_FAILED
        if not isinstance(exc, FileNotFoundError):
            raise
        print(f"posttrain: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (FileNotFoundError, ValueError) as exc:
        from posttrain.data.errors import DataError
        from posttrain.train.identity import ResumeError

        if isinstance(exc, DataError | FileNotFoundError | ResumeError):
            print(f"posttrain: {exc}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        raise
