"""The ``posttrain`` command line: one entry point, one subcommand per recipe or tool.

Recipe subcommands (``sft``, ``dpo``, …) all take ``--config FILE_OR_NAME`` plus dotted ``key=value``
overrides and come from the recipe registry; their ``--help`` lists every config key, generated from the
schema. Tool subcommands (``data inspect``, ``generate``, ``eval``, ``recipes``, …) live next to their
code; each module in ``TOOL_COMMANDS`` exposes ``register(subparsers)`` and sets ``func`` on its parser.

First contact must be fast: building the parser imports only argparse, pydantic, yaml and the config
schemas. torch, transformers, numpy, fsspec… are imported inside the functions that run a command
(``tests/test_cli_imports.py`` fails if ``--help`` or ``validate`` import them). A command line that names
its subcommand first (``posttrain curate …``) builds only that subcommand's parser (``build_parser(command)``):
every other command's module and recipe schema stays unimported (0.15 s of a 3 s ``posttrain curate``).

Failures keep the exit codes' promise. Bad config or input (``BAD_INPUT_ERRORS``, missing paths) exits
2 with one line that says what is wrong; anything else is a bug, reported in one line as ``posttrain:
internal error: <type>: <message>`` with exit 1. ``posttrain --debug <command> ...`` also prints the
traceback, with the same exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
import traceback
from typing import TYPE_CHECKING

from posttrain import __version__
from posttrain.collector import cycle_collection_paused
from posttrain.exit_codes import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_RESUMABLE

if TYPE_CHECKING:
    from posttrain.config.registry import RecipeSpec

# Each tool command, in `posttrain --help` order, and the module whose ``register(subparsers)`` adds it (that
# command alone: tests/test_cli_help.py holds the two to each other).
TOOL_COMMANDS = {
    "validate": "posttrain.commands.validate",
    "recipes": "posttrain.commands.recipes",
    "data": "posttrain.data.inspect",
    "model": "posttrain.commands.model",
    "quickstart": "posttrain.commands.quickstart",
    "report": "posttrain.commands.report",
    "launch": "posttrain.commands.launch",
    "k8s": "posttrain.commands.k8s",
    "plan": "posttrain.commands.plan",
    "generate": "posttrain.generate.cli",
    "eval": "posttrain.eval.cli",
    "serve": "posttrain.serve.cli",
}
# Each built-in recipe and the module whose import registers it (one of posttrain.config.registry's modules, the
# training schemas' apart from the curation ones: tests/test_cli_help.py holds the table to the registry).
RECIPE_MODULES = {
    "sft": "posttrain.config.recipes",
    "pretrain": "posttrain.config.recipes",
    "curate": "posttrain.curate.config",
    "sample": "posttrain.curate.config",
    "feedback": "posttrain.curate.config",
    "dpo": "posttrain.config.preference",
    "rm": "posttrain.config.preference",
    "grpo": "posttrain.config.rl",
    "flywheel": "posttrain.flywheel.config",
}
# Tool actions under a recipe's name: `posttrain feedback export …` beside the recipe `posttrain feedback --config …`
# (a recipe parser takes free `key=value` words, so these are dispatched before argparse sees them).
RECIPE_ACTIONS = {("feedback", "export"): ("posttrain.serve.cli", "run_export", "export the feedback service's votes")}

# Raised for bad config or bad input; each message says what is wrong and how to fix it. Named by module so
# that recognising them imports nothing: a class whose module was never loaded cannot have been raised.
BAD_INPUT_ERRORS = (
    ("posttrain.config.loader", "ConfigError"),
    ("posttrain.data.errors", "DataError"),
    ("posttrain.data.formats", "FormatError"),
    ("posttrain.data.chat", "TemplateError"),
    ("posttrain.train.source", "BatchSizeError"),
    ("posttrain.train.identity", "ResumeError"),
    ("posttrain.algorithms.registry", "UnknownNameError"),
    ("posttrain.eval.harness", "MissingOutputs"),
    ("posttrain.eval.pairing", "IncomparableResults"),
    ("posttrain.eval.sandbox", "SandboxUnavailable"),
    ("posttrain.tasks.problem", "TaskSpaceExhausted"),
    ("posttrain.generate.vllm_server", "EngineSetupError"),
    ("posttrain.models.lora", "LoraSetupError"),
    ("posttrain.models.moe", "MoeConfigError"),
    ("posttrain.k8s.options", "RenderError"),
    ("posttrain.data.storage", "StorageUnavailable"),
    ("posttrain.telemetry.trackers", "TrackerUnavailable"),
    ("posttrain.serve.db", "FeedbackDBError"),
    ("posttrain.report.detect", "NotARunDirectory"),
    ("posttrain.flywheel.stages", "StageInputError"),
    ("posttrain.store.lock", "RunDirError"),
    ("posttrain.store.manifest", "ManifestError"),
    ("posttrain.store.manifest", "CheckpointSignatureError"),
    ("posttrain.rl.reward_config", "RewardSetupError"),
    ("posttrain.generate.engine", "SamplingError"),
)
# The machine, not the input and not a bug: one line and exit 1 (e.g. a full disk; the message says what to do).
ENVIRONMENT_ERRORS = (("posttrain.train.checkpoint", "DiskFullError"), ("posttrain.data.storage", "StorageAccessError"))
# The store is down past store.max_outage_s, or the rollout engine died twice: nothing is lost, the same command
# resumes later from the newest checkpoint (exit 75).
RESUMABLE_ERRORS = (("posttrain.store.run_store", "StoreUnavailable"),
                    ("posttrain.generate.vllm_server", "EngineUnavailable"))
# A path given on the command line or in a config that cannot be used as asked.
BAD_PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)

EPILOG = f"""\
exit codes: {EXIT_OK} ok, {EXIT_FAILED} failed, {EXIT_BAD_CONFIG} bad config or input,
            {EXIT_RESUMABLE} resumable: preempted after saving a checkpoint, a stall, the run store
               unreachable past store.max_outage_s, or the rollout engine dead after its one restart
               (rerun the same command to resume)
errors:     one line each; a bug reads `posttrain: internal error: ...` (exit {EXIT_FAILED}):
            rerun with `posttrain --debug COMMAND ...` for the traceback
threads:    OMP_NUM_THREADS if set, else every core; OMP_WAIT_POLICY=PASSIVE unless set (see posttrain.threads)
"""

CONFIG_HELP = "YAML recipe: a file, or a packaged recipe's name (see `posttrain recipes list`)"


def _add_recipe_command(subparsers: argparse._SubParsersAction, spec: RecipeSpec) -> None:
    from posttrain.config.keys import format_config_keys

    name = spec.name
    actions = "".join(f"\n       posttrain {name} {action} ... ({what}; see `posttrain {name} {action} --help`)"
                      for (recipe, action), (_, _, what) in RECIPE_ACTIONS.items() if recipe == name)
    parser = subparsers.add_parser(
        name,
        help=spec.summary,
        description=f"{spec.summary}\n\nRun the `{name}` recipe: "
        f"posttrain {name} --config FILE_OR_NAME [key=value ...]" + (f"\nAlso: {actions.strip()}" if actions else ""),
        epilog=format_config_keys(spec.schema),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help=f"{CONFIG_HELP}; may be omitted when overrides give every required key")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=3e-4")
    if "train" in spec.schema.model_fields:
        parser.add_argument("--force-resume", action="store_true",
                            help="resume even from a checkpoint whose run identity cannot be read "
                            "(train.resume=force); its files are still checked against the manifest")
    parser.set_defaults(func=_run_recipe_command, recipe_name=name)


def _recipe_named(name: str) -> RecipeSpec | None:
    """The built-in recipe ``name``, registered by importing its module alone (``RECIPE_MODULES``)."""
    from posttrain.config.registry import RECIPES

    if name in RECIPE_MODULES:
        importlib.import_module(RECIPE_MODULES[name])
    return RECIPES.get(name)


def _run_recipe_command(args: argparse.Namespace) -> int:
    from posttrain.config import load_config
    from posttrain.config.registry import RECIPES, run_recipe

    name = args.recipe_name
    overrides = [*args.overrides, f"recipe={name}"] + (["train.resume=force"] if getattr(args, "force_resume", False)
                                                        else [])
    config = load_config(RECIPES[name].schema, args.config, overrides)
    model_path = getattr(getattr(config, "model", None), "path", None)
    if isinstance(model_path, str):
        from posttrain.models.source import check_model_path

        # Before the recipe imports torch and transformers (seconds on a busy machine): a mistyped path or a hub
        # id with no network is told at once. start_run asks again (answered from this process's memory).
        check_model_path(model_path)
    return run_recipe(name, config)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line: every subcommand, or, given ``command`` (``command_of(argv)``), only that one, whose
    parser and help are the same either way. A ``command`` that names no subcommand gets them all, so that
    argparse's error lists every choice."""
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-training for causal LMs: curate, SFT with a curriculum, DPO-family alignment, eval.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="when a command fails, also print the traceback (the exit code stays the same)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    if command in TOOL_COMMANDS:
        importlib.import_module(TOOL_COMMANDS[command]).register(subparsers)
        return parser
    spec = _recipe_named(command) if command is not None else None
    if spec is not None:
        _add_recipe_command(subparsers, spec)
        return parser
    from posttrain.config.registry import RECIPES, load_builtin_recipes

    for module_name in TOOL_COMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    load_builtin_recipes()
    for spec in RECIPES.values():
        _add_recipe_command(subparsers, spec)
    return parser


# Commands that end by writing and closing every output they make: after a success the process leaves without
# interpreter teardown (``exit_codes.exit_process``), which would only free what they hold, one object at a time.
# Decided here, for the command line alone: the same code called in a longer process (the flywheel's curate stage)
# leaves that process's ending as it was.
TEARDOWN_FREE_COMMANDS = frozenset({"curate"})


def command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` runs when its first word (after ``--debug``) names it; None when an option comes
    first (``--help``, ``--version``, an abbreviated ``--debug``): argparse then sees the whole command line."""
    words = argv[1:] if argv[:1] == ["--debug"] else argv
    return words[0] if words and not words[0].startswith("-") else None


def _is_one_of(exc: BaseException, table: tuple[tuple[str, str], ...]) -> bool:
    """Whether ``exc`` is an instance of a class in ``table`` (looked up by module, so nothing is imported)."""
    for module_name, class_name in table:
        module = sys.modules.get(module_name)
        error = getattr(module, class_name, None) if module else None
        if error is not None and isinstance(exc, error):
            return True
    return False


def is_bad_input(exc: BaseException) -> bool:
    """Whether ``exc`` reports bad config or input (exit 2) rather than a bug (exit 1)."""
    return isinstance(exc, BAD_PATH_ERRORS) or _is_one_of(exc, BAD_INPUT_ERRORS)


def stdout_closed() -> bool:
    """Whether stdout's reader has gone (``posttrain validate … | head``): polling its pipe reports an error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor (captured output), or no poll() here
        return False


def silence_stdout() -> None:
    """stdout's reader has gone: what is left to print is nobody's. stdout now goes to /dev/null, so that the
    interpreter's last flush does not fail again (with a traceback) on the way out."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def report_failure(exc: BaseException, debug: bool) -> int:
    """Print a failed command's message (and, with ``debug``, its traceback); return its exit code."""
    if isinstance(exc, BrokenPipeError) and stdout_closed():
        silence_stdout()  # `… | head` read what it wanted: the command did its job (exit 0, as `cat` under head)
        return EXIT_OK
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    config_error = sys.modules.get("posttrain.config.loader")
    if config_error is not None and isinstance(exc, config_error.ConfigError):
        print(f"posttrain: invalid config\n{exc}", file=sys.stderr)  # one line per bad key
        return EXIT_BAD_CONFIG
    message = " ".join(str(exc).split()) or type(exc).__name__
    if _is_one_of(exc, RESUMABLE_ERRORS):
        print(f"posttrain: {message}; rerun the same command to resume (exit {EXIT_RESUMABLE})", file=sys.stderr)
        return EXIT_RESUMABLE
    if _is_one_of(exc, ENVIRONMENT_ERRORS):
        print(f"posttrain: {getattr(exc, 'strerror', None) or message}", file=sys.stderr)
        return EXIT_FAILED
    if is_bad_input(exc):
        print(f"posttrain: {message}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(f"posttrain: internal error: {type(exc).__name__}: {message} (rerun with --debug for the traceback)",
          file=sys.stderr)
    return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"] and argv[1:2] not in (["-h"], ["--help"]):
        # torchrun's own options (--nproc_per_node …) come first: argparse would take them for posttrain's.
        from posttrain.commands.launch import launch

        return launch(argv[1:])
    debug = argv[:1] == ["--debug"]
    if tuple(argv[debug : debug + 2]) in RECIPE_ACTIONS:
        module_name, function, _ = RECIPE_ACTIONS[tuple(argv[debug : debug + 2])]  # type: ignore[index]
        try:
            return int(getattr(importlib.import_module(module_name), function)(argv[debug + 2 :]) or 0)
        except Exception as exc:  # noqa: BLE001 - the same one-line failures as every other command
            return report_failure(exc, debug)
    # Building the parser imports pydantic and the recipe's schemas, which the cyclic collector would otherwise walk
    # some 45 times on the way (0.04 s of `posttrain curate`; posttrain.collector says why pausing it is safe).
    with cycle_collection_paused():
        parser = build_parser(command_of(argv))
        args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_CONFIG
    from posttrain.threads import configure_threads

    # Every command, before any of them imports torch: OpenMP reads its settings once, when it loads.
    # Commands that never run torch (validate, recipes) only get two environment variables set.
    configure_threads(None)
    try:
        return int(args.func(args) or 0)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        return report_failure(exc, args.debug)
