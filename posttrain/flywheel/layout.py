"""What each flywheel stage runs: its recipe, its overrides merged over it, and the wiring — the paths of the
run directory the flywheel sets on top (``output_dir``, the inputs earlier stages wrote).

``run_flywheel`` resolves every stage's config here before the first stage starts (a wrong key or type in
any stage's overrides is exit 2 then, not after an hour of pretraining), and wires each stage from the same
table when it runs; ``posttrain validate --stage NAME`` prints one of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from posttrain.flywheel.config import FlywheelRecipe, StageRecipe
from posttrain.flywheel.overrides import stage_config

# next_round's overrides of each stage, merged over the stage's own from round 2 on (see ``rounds``).
LATER_ROUND_STAGES = ("curate", "sft", "sample", "dpo")


def planned_inputs(config: FlywheelRecipe) -> tuple[dict[str, str], dict[str, str]]:
    """The outputs of the ``data`` and ``base`` stages, before they have run: the user's files where given,
    else the paths ``stage_data`` and ``stage_base`` write."""
    run_dir = Path(config.run_dir)
    spec = config.data
    data = {"raw": spec.raw_pool if isinstance(spec.raw_pool, str) else str(run_dir / "data" / "raw.jsonl"),
            "prompts": spec.rl_prompts if isinstance(spec.rl_prompts, str) else str(run_dir / "data" / "prompts.jsonl"),
            "corpus": str(run_dir / "data" / "corpus.txt")}
    base = {"model": config.base.model or str(run_dir / "base" / "pretrain" / "final")}
    return data, base


def round_one_stages(config: FlywheelRecipe, data: dict[str, Any], base: dict[str, Any],
                     dpo_trained: bool = True) -> dict[str, tuple[StageRecipe, dict[str, Any]]]:
    """Round 1's recipe stages in the order they run: name (also the recipe kind) → (stage, wiring).

    ``data``/``base``: the outputs of those stages (``planned_inputs`` before a run). ``dpo_trained=False``: the
    DPO stage was skipped, so GRPO starts from the SFT model. GRPO's eval prompts are wired as planned; the
    stage holds out fewer when the round has few RL prompts (``stage_grpo``)."""
    run_dir = Path(config.run_dir)
    sft_model = str(run_dir / "sft" / "final")
    stages: dict[str, tuple[StageRecipe, dict[str, Any]]] = {}
    if config.base.model is None and config.base.pretrain is not None:
        out = run_dir / "base"
        stages["pretrain"] = (config.base.pretrain, {"model.path": str(out / "init"), "data.train": data["corpus"],
                                                     "output_dir": str(out / "pretrain")})
    wiring = {
        "curate": {"data.input": data["raw"]},
        "sft": {"model.path": base["model"], "data.train": str(run_dir / "curate" / "kept.jsonl")},
        "sample": {"data.input": data["prompts"], "policy.path": sft_model},
        "dpo": {"model.path": sft_model, "data.train": str(run_dir / "sample" / "preferences.jsonl"), "data.eval": None},
    }
    for name, values in wiring.items():
        stages[name] = (getattr(config, name), {**values, "output_dir": str(run_dir / name)})
    if config.grpo is not None:
        out = run_dir / "grpo"
        start = str(run_dir / "dpo" / "final") if dpo_trained else sft_model
        grpo = {"model.path": start, "data.train": str(out / "prompts.jsonl"), "output_dir": str(out)}
        if config.grpo.eval_prompts:
            grpo["data.eval"] = str(out / "eval_prompts.jsonl")
        stages["grpo"] = (config.grpo, grpo)
    return stages


def later_round_stage(config: FlywheelRecipe, name: str) -> StageRecipe:
    """Stage ``name`` as rounds 2..N run it: ``next_round.<name>`` merged over the stage's overrides key by key
    (intent labels on for curation unless ``next_round.curate`` says otherwise)."""
    base: StageRecipe = getattr(config, name)
    extra = {"intent.enabled": True} if name == "curate" else {}
    return StageRecipe(recipe=base.recipe, overrides={**base.overrides, **extra, **getattr(config.next_round, name)})


def resolve_stages(config: FlywheelRecipe, grpo: bool = False) -> dict[str, BaseModel]:
    """Every stage's effective config, by stage name (``next_round.sft``: the SFT of rounds 2..N): ConfigError
    for the first stage whose overrides do not make a valid config of its recipe. Later rounds are resolved
    with round 1's wiring: their paths differ, their keys and values do not. GRPO only when it runs
    (``grpo.enabled``) or ``grpo`` asks for it: its config's checks import torch, which ``posttrain validate``
    of a flywheel recipe otherwise never needs (its keys are checked with the flywheel config all the same)."""
    data, base = planned_inputs(config)
    stages = round_one_stages(config, data, base)
    if not (grpo or (config.grpo is not None and config.grpo.enabled)):
        stages.pop("grpo", None)
    resolved = {name: stage_config(name, name, stage.recipe, stage.overrides, wiring)
                for name, (stage, wiring) in stages.items()}
    for name in LATER_ROUND_STAGES:  # checked with one round too: `quickstart --rounds N` turns them on
        label, stage = f"next_round.{name}", later_round_stage(config, name)
        resolved[label] = stage_config(name, label, stage.recipe, stage.overrides, stages[name][1],
                                       owner=f"{name}.overrides + {label}")
    if config.next_round.sft_from_samples and resolved["next_round.sample"].min_score is None:
        from posttrain.config.loader import ConfigError

        raise ConfigError(["next_round.sft_from_samples: true would train round k's SFT on every best-of-n answer, "
                           "wrong ones included; set next_round.sample.min_score (1.0 with verifiers: only answers "
                           "that pass)"])
    return resolved
