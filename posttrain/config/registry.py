"""Recipe registry: a recipe name maps to its config schema and the function that runs it.

A YAML recipe names its kind in its top-level ``recipe:`` key, so ``posttrain validate`` can check
any recipe file without being told which command it is for.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from pydantic import BaseModel


@dataclass(frozen=True)
class RecipeSpec:
    name: str
    schema: type[BaseModel]
    runner: str  # "module:function", imported only when the recipe runs (keeps the CLI fast)
    summary: str


RECIPES: dict[str, RecipeSpec] = {}

# Modules whose import registers recipes. Each feature registers its own recipe next to its code.
_BUILTIN_MODULES = ("posttrain.config.recipes", "posttrain.curate.config", "posttrain.config.preference", "posttrain.config.rl",
                    "posttrain.flywheel.config")


def register_recipe(name: str, schema: type[BaseModel], runner: str, summary: str) -> None:
    if name in RECIPES:
        raise ValueError(f"recipe {name!r} is already registered (by {RECIPES[name].runner})")
    RECIPES[name] = RecipeSpec(name, schema, runner, summary)


def load_builtin_recipes() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def run_recipe(name: str, config: BaseModel) -> int:
    """Run a recipe; a SIGTERM/SIGINT outside its training loop ends it with exit 75 (see ``exit_codes``)."""
    import signal

    from posttrain.exit_codes import Preempted, raise_preempted_on_signals, report_preempted

    module_name, _, function_name = RECIPES[name].runner.partition(":")
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    raise_preempted_on_signals()
    try:
        runner = getattr(importlib.import_module(module_name), function_name)
        return int(runner(config) or 0)
    except Preempted as exc:
        return report_preempted(exc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # The run is over: its output_dir lock and S3 lease go now, not at exit — a distributed rank leaves through
        # os._exit (no atexit), and in-process callers (the flywheel, tests) start other runs afterwards.
        lock = sys.modules.get("posttrain.store.lock")
        if lock is not None:
            lock.release_held()
