"""``posttrain validate --config FILE_OR_NAME [--stage NAME] [key=value ...]``: check a recipe without running it."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="Check a YAML recipe (unknown keys, types, cross-field rules) and exit non-zero on problems.",
        description="Validate a recipe: its top-level `recipe:` key picks the schema. Prints the resolved "
        "config on success; on failure lists every problem with file:line, key and the fix. A flywheel recipe "
        "is checked stage by stage too: each stage's recipe with its overrides merged over it.",
    )
    parser.add_argument("--config", required=True,
                        help="YAML recipe: a file, or a packaged recipe's name (see `posttrain recipes list`)")
    parser.add_argument("--stage", metavar="NAME",
                        help="flywheel recipes: print the config stage NAME runs with instead (its recipe, its "
                        "overrides merged key by key, the run directory's paths): pretrain, curate, sft, sample, "
                        "dpo, grpo, or next_round.sft etc. for rounds 2..N")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")
    parser.set_defaults(func=_validate)


def _validate(args: argparse.Namespace) -> int:
    import yaml

    from posttrain.config import ConfigError, resolve_recipe
    from posttrain.config.loader import nearest_keys

    name, config = resolve_recipe(args.config, args.overrides)
    stages = {}
    if name == "flywheel":
        from posttrain.flywheel.layout import resolve_stages

        stages = resolve_stages(config, grpo=args.stage == "grpo")  # type: ignore[arg-type]
    elif args.stage:
        raise ConfigError([f"--stage {args.stage}: {args.config} is a `{name}` recipe; only flywheel recipes have "
                           "stages (validate it without --stage)"])
    if args.stage and args.stage not in stages:
        guess = nearest_keys(args.stage, list(stages))
        hint = f"did you mean `{guess[0]}`?" if guess else f"stages: {', '.join(stages)}"
        raise ConfigError([f"--stage {args.stage}: no such stage in {args.config}; {hint}"])
    if args.quiet:
        return 0
    if args.stage:
        print(f"{args.config}: stage {args.stage} runs with")
        print(yaml.safe_dump(stages[args.stage].model_dump(mode="json"), sort_keys=False).rstrip())
        return 0
    print(f"{args.config}: valid `{name}` recipe")
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False).rstrip())
    if stages:
        print("# each stage's recipe with its overrides merged over it (`--stage NAME` prints one whole):")
        for label, stage in stages.items():
            print(f"# stage {label}: valid `{stage.recipe}` config")  # type: ignore[attr-defined]
    return 0
