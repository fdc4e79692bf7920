"""Flywheel rounds 2..N: each starts from the previous round's final model and learns from its failures.

Round k lives in ``<run_dir>/round<k>/`` and runs, as cached stages of the same ``StageRunner``:

    data      a fresh raw pool (seed + 1000·(k-1); with withheld answer keys and planted off-topic
              answers, so rules alone cannot clean it), fresh RL prompts, and a dev suite
    capture   the previous final model on the dev suite; failures + sampled alternatives → the service
    annotate  the scripted verifier annotator votes on every pair, with reasons
    export    the vote log → preference pairs, SFT examples, merge input, with lineage
    curate    the new pool, with the previous round's policy as judge (``model_judge``) and intent labels
    sample    rejection sampling of the new RL prompts with the previous final model
    sft_data  with ``next_round.sft_from_samples``: the curated records plus the sample stage's verified
              best-of-n answers (rejection-sampling fine-tuning on the previous final model's own outputs);
              with ``next_round.replay``: plus the previous round's curated records
    feedback  ``posttrain feedback``: the exported edge cases merged into the curated SFT set and the
              sampled preference set (deduplicated against both)
    sft, dpo  continued from the previous final model on the merged sets (DPO skipped, with its reason,
              below ``dpo.min_pairs``: the round's final model is then its SFT model)
    grpo      with ``grpo.enabled``: GRPO from the round's DPO model on the round's fresh RL prompts of
              ``grpo.groups``, as in round 1 — every round runs the whole pipeline, so round k's final model
              is compared with round k-1's like with like
    eval_sft, eval_dpo, eval_grpo, compare   on the round-1 held-out eval suite, so every round is scored alike

``rounds.json`` (written by ``write_rounds_index``) lists the rounds for the report, and
``across/comparisons.json`` compares each round's final model with the previous round's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.flywheel.config import FlywheelRecipe, StageRecipe
from posttrain.flywheel.stages import StageRunner

# A later round's stages name the previous round's final stage by this in their ``depends_on``.
START = "<previous round's final stage>"
# What to change when a later round's DPO stage gets too few pairs: how to get more, where the minimum is set.
LATER_PAIRS_HINT = ("raise next_round.rl_prompts or feedback.samples", "next_round.dpo.dpo.min_pairs")


def file_fingerprint(path: str, what: str) -> dict[str, Any]:
    """What a cached stage keys a user's input file (config key ``what``) on: its size and modification
    time (cheap; a changed file re-runs the stages that read it)."""
    stat = Path(user_file(path, what)).stat()
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def user_file(path: str, what: str) -> str:
    if not Path(path).exists():
        raise FileNotFoundError(f"{what}: {path} does not exist")
    return path


def stage_round_data(config: FlywheelRecipe, round_index: int, out: Path) -> dict[str, Any]:
    from posttrain.data.io import write_jsonl, write_records
    from posttrain.tasks.emit import eval_items, rl_prompts
    from posttrain.tasks.pool import NoiseMix, raw_pool

    spec, seed = config.next_round, config.seed + 1000 * (round_index - 1)
    if isinstance(spec.raw_pool, str):
        raw = user_file(spec.raw_pool, "next_round.raw_pool")
    else:
        pool = raw_pool(spec.raw_pool, seed, noise=NoiseMix(off_topic=spec.off_topic_share),
                        preamble_share=config.data.preamble_share, unkeyed_share=spec.unkeyed_share)
        raw = str(out / "raw.jsonl")
        write_jsonl(raw, pool)
    if isinstance(spec.rl_prompts, str):
        prompts = user_file(spec.rl_prompts, "next_round.rl_prompts")
    else:
        prompts = str(out / "prompts.jsonl")
        write_records(prompts, rl_prompts(spec.rl_prompts, seed + 1))
    if config.feedback.dev_suite:
        dev = user_file(config.feedback.dev_suite, "feedback.dev_suite")
    else:  # train-split problems: what the model meets in use, never an item of the held-out eval suite
        dev = str(out / "dev_suite.jsonl")
        write_jsonl(dev, eval_items(config.feedback.dev_per_cell, seed + 2, split="train"))
    return {"raw": raw, "prompts": prompts, "dev_suite": dev}


def run_next_round(config: FlywheelRecipe, runner: StageRunner, run_dir: Path, round_index: int,
                   previous: dict[str, Any], suite: str,
                   stage_eval: Callable[..., dict[str, Any]], stage_compare: Callable[..., dict[str, Any]],
                   run_stage: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """Run round ``round_index`` from ``previous`` (``{"label", "model", "stage", "results"}`` of the
    previous round's final model); return the round's entry for ``rounds.json``."""
    from posttrain.flywheel import feedback_loop as loop

    prefix = f"round{round_index}"
    here = run_dir / prefix
    dump = config.model_dump(mode="json")
    spec = config.next_round
    files = {name: file_fingerprint(value, key) for name, key, value in
             (("raw", "next_round.raw_pool", spec.raw_pool), ("prompts", "next_round.rl_prompts", spec.rl_prompts),
              ("dev", "feedback.dev_suite", config.feedback.dev_suite))
             if isinstance(value, str)}  # fmt: skip
    def stage(name: str, key: Any, depends_on: list[str], body: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        """Stage ``<prefix>/<name>``; ``depends_on`` names this round's stages, and ``START`` the previous round's
        final one. (Matching by name would be wrong: round 1's final stage ``dpo`` or ``grpo`` has the name of this
        round's own, and a changed round-k stage would not re-run the stages that read it.)"""
        inputs = [previous["stage"] if d == START else f"{prefix}/{d}" for d in depends_on]
        return runner.run(f"{prefix}/{name}", key, inputs, body)

    data_options = {k: dump["next_round"][k] for k in ("raw_pool", "rl_prompts", "unkeyed_share", "off_topic_share")}
    dev_options = {k: dump["feedback"][k] for k in ("dev_per_cell", "dev_suite")}
    data = stage("data", {"seed": config.seed, "round": round_index, **data_options, **dev_options,
                          "preamble": config.data.preamble_share, "files": files},
                 [], lambda out: stage_round_data(config, round_index, out))
    feedback = {k: v for k, v in dump["feedback"].items()  # an option added later, off: old caches stay valid
                if not (k == "reference_answers" and v is False)}
    loop_key = {"feedback": feedback, "eval": dump["eval"]}
    stage("capture", loop_key, [START, "data"],
          lambda out: loop.stage_capture(config, round_index, previous["model"], previous["label"],
                                         data["dev_suite"], run_dir, out))
    stage("annotate", loop_key, ["capture"],
          lambda out: loop.stage_annotate(config, round_index, data["dev_suite"], run_dir, out))
    exported = stage("export", {}, ["annotate"], lambda out: loop.stage_export(run_dir, out))

    def recipe(name: str, base: StageRecipe, extra: dict[str, Any], depends_on: list[str],
               wiring: dict[str, Any], **options: Any) -> dict[str, Any]:
        """Stage ``name``: ``extra`` (next_round's overrides) merged over the stage's own key by key."""
        merged = StageRecipe(recipe=base.recipe, overrides={**base.overrides, **extra})
        owner = f"{name}.overrides + next_round.{name}" if extra else None

        def body(out: Path) -> dict[str, Any]:
            return run_stage(name, merged, {**wiring, "output_dir": str(out)}, out, label=f"{prefix}/{name}",
                             owner=owner, **options)

        return stage(name, {"stage": merged.model_dump(mode="json"), "wiring": wiring}, depends_on, body)

    judge = {"model_judge.enabled": spec.model_judge, "model_judge.model": previous["model"]} if spec.model_judge else {}
    recipe("curate", config.curate, {"intent.enabled": True, **spec.curate}, ["data", START],
           {"data.input": data["raw"], **judge})
    recipe("sample", config.sample, spec.sample, ["data", START],
           {"data.input": data["prompts"], "policy.path": previous["model"]})
    sft_set, sft_inputs = str(here / "curate" / "kept.jsonl"), ["curate"]
    sources = {"curate/kept.jsonl": here / "curate" / "kept.jsonl"}
    if spec.sft_from_samples:  # the previous model's own verified best-of-n answers
        sources["sample/sft.jsonl"] = here / "sample" / "sft.jsonl"
    if spec.replay:  # the previous round's curated records (its final stage depends on them: START covers them)
        sources["previous/curate/kept.jsonl"] = run_dir / previous["dir"] / "curate" / "kept.jsonl"
    if len(sources) > 1:
        depends = ["curate"] + (["sample"] if spec.sft_from_samples else []) + ([START] if spec.replay else [])
        sft_set = stage("sft_data", {"sources": list(sources)}, depends,
                        lambda out: concatenate_jsonl(sources, out / "sft.jsonl"))["sft"]
        sft_inputs = ["sft_data"]
    recipe("feedback", StageRecipe(recipe="curate_feedback"), {}, [*sft_inputs, "sample", "export"],
           {"feedback": exported["feedback"], "sft": sft_set,
            "preferences": str(here / "sample" / "preferences.jsonl")})
    recipe("sft", config.sft, spec.sft, [START, "feedback"],
           {"model.path": previous["model"], "data.train": str(here / "feedback" / "sft.jsonl")})
    dpo = recipe("dpo", config.dpo, spec.dpo, ["sft", "feedback"],
                 {"model.path": str(here / "sft" / "final"), "data.train": str(here / "feedback" / "preferences.jsonl"),
                  "data.eval": None}, hint=LATER_PAIRS_HINT)
    models = ["sft"] if dpo.get("skipped") else ["sft", "dpo"]
    if dpo.get("skipped"):
        runner.log(f"{prefix}/dpo: no DPO model this round. {dpo['skipped']}")
    if config.grpo is not None and config.grpo.enabled:  # every round is the whole pipeline: GRPO after DPO too
        from posttrain.flywheel.run import stage_grpo

        rl_start = str(here / models[-1] / "final")
        stage("grpo", {"grpo": dump["grpo"]}, [models[-1], "data"],
              lambda out: stage_grpo(config, data, rl_start, out, label=f"{prefix}/grpo"))
        models.append("grpo")
    evals = {"start": previous["results"]}
    for label in models:
        result = stage(f"eval_{label}", {"eval": dump["eval"], "model": f"{prefix}/{label}"}, [label],
                       lambda out, lab=label: stage_eval(str(here / lab / "final"), suite, config, out,
                                                         f"{prefix}/{lab}"))
        evals[label] = result["results"]
    pairs = [("start", "sft"), ("sft", "dpo"), ("start", "dpo")] if "dpo" in models else [("start", "sft")]
    if "grpo" in models:
        pairs += [(models[-2], "grpo"), ("start", "grpo")]
    stage("compare", dump["eval"], [f"eval_{label}" for label in models],
          lambda out: stage_compare(evals, config, out, pairs))
    capture = runner.results[f"{prefix}/capture"].outputs
    annotate = runner.results[f"{prefix}/annotate"].outputs
    final = models[-1]
    return {
        "round": round_index, "dir": prefix, "models": models, "final": final,
        "start": previous["label"], "captured_groups": sorted(capture.get("failures_by_group", {})),
        "counts": {"captured": capture.get("failures", 0), "alternatives": capture.get("alternatives", 0),
                   "votes": annotate.get("votes", 0), "pairs": exported["counts"].get("exported", 0),
                   "dev_items": capture.get("dev_items", 0), "dev_passed": capture.get("dev_passed", 0)},
        "model": str(here / final / "final"), "stage": f"{prefix}/{final}", "label": f"{prefix}/{final}",
        "results": evals[final], **({"skipped": {"dpo": dpo["skipped"]}} if dpo.get("skipped") else {}),
    }  # fmt: skip


def concatenate_jsonl(sources: dict[str, Path], target: Path) -> dict[str, Any]:
    """``target``: the records of ``sources`` (label → file) one after another, and how many each gave (the
    feedback merge that reads it deduplicates)."""
    counts = {}
    with target.open("w", encoding="utf-8") as out:
        for label, source in sources.items():
            lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
            out.writelines(line + "\n" for line in lines)
            counts[label] = len(lines)
    return {"sft": str(target), "counts": counts}


def write_rounds_index(run_dir: Path, rounds: list[dict[str, Any]], config: FlywheelRecipe,
                       stage_compare: Callable[..., dict[str, Any]]) -> Path:
    """``rounds.json`` and ``across/comparisons.json``: each round's final model against the previous one's
    (and the first round's against the last), paired by item on the same held-out suite."""
    across = run_dir / "across"
    across.mkdir(exist_ok=True)
    finals = {entry["label"]: entry["results"] for entry in rounds}
    labels = list(finals)
    pairs = list(zip(labels, labels[1:], strict=False))
    if len(labels) > 2:
        pairs.append((labels[0], labels[-1]))
    stage_compare(finals, config, across, pairs)
    index = {
        "rounds": [{k: v for k, v in entry.items() if k not in ("stage", "results")} for entry in rounds],
        "across": "across/comparisons.json",
    }
    path = run_dir / "rounds.json"
    path.write_text(json.dumps(index, indent=1))
    return path
