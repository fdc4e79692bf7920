"""``posttrain quickstart``: one whole flywheel round on the embedded default (what ``make demo`` runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.config.loader import load_config

DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quickstart",
        help="One flywheel round offline on the CPU: pool → curate → SFT → sample → DPO → eval → report.html.",
        description=(
            "Runs recipes/quickstart.yaml (same as `posttrain flywheel --config recipes/quickstart.yaml`). "
            "Stages are cached: a re-run skips finished stages, an interrupted run resumes."
        ),
    )
    parser.add_argument("--config", default=str(DEFAULT_RECIPE), help="flywheel recipe (default: recipes/quickstart.yaml)")
    parser.add_argument("--run-dir", help="where the round writes its stages and report (default: runs/quickstart)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.set_defaults(func=_quickstart)


def _quickstart(args: argparse.Namespace) -> int:
    from posttrain.flywheel.config import FlywheelRecipe
    from posttrain.flywheel.run import run_flywheel

    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    return run_flywheel(load_config(FlywheelRecipe, args.config, overrides))
