"""Run flywheel rounds as cached stages (see ``posttrain.flywheel.stages``).

Round 1: data → base model (the user's, or pretrained here) → curate → SFT (tiered curriculum) →
rejection sampling → DPO → (GRPO with the verifier reward, with ``grpo.enabled``) → eval of every
model → paired comparisons. Rounds 2..N (``rounds``): ``posttrain.flywheel.rounds``. Then
``report.html`` + ``report.json``.

Every stage runs the same recipe code a user runs from the CLI; the flywheel only wires paths
(``posttrain.flywheel.layout``). A DPO stage with fewer pairs than its ``dpo.min_pairs`` does not train:
its ``stage.json`` records why, the round goes on to eval without a DPO model, and the report says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from posttrain.config.registry import run_recipe
from posttrain.exit_codes import EXIT_RESUMABLE
from posttrain.flywheel.config import FlywheelRecipe, StageRecipe
from posttrain.flywheel.layout import resolve_stages, round_one_stages
from posttrain.flywheel.overrides import stage_config
from posttrain.flywheel.stages import StageRunner, count_pairs, skipped_dpo
from posttrain.threads import configure_threads

NEW_DATA_DEFAULTS = {"unkeyed_share": 0.0, "off_topic_share": 0.0}
# What to change when round 1's DPO stage gets too few pairs: how to get more, where the minimum is set
# (rounds 2..N say their own: ``rounds``).
ROUND_ONE_PAIRS_HINT = ("raise data.rl_prompts or the sample stage's sampling.n / temperature",
                        "dpo.overrides.dpo.min_pairs")


class StageInterrupted(RuntimeError):
    """A training stage was preempted; its checkpoint is saved and a re-run resumes it."""


def run_stage_recipe(name: str, stage: StageRecipe, wiring: dict[str, Any], label: str | None = None,
                     owner: str | None = None) -> None:
    """Run a registered recipe from its YAML + the stage's overrides (merged key by key) + the flywheel's wiring."""
    run_stage_config(name, stage_config(name, label or name, stage.recipe, stage.overrides, wiring, owner))


def run_stage_config(name: str, config: BaseModel) -> None:
    code = run_recipe(name, config)
    if code == EXIT_RESUMABLE:
        raise StageInterrupted(f"{name} was preempted; rerun the same command to resume")
    if code != 0:
        raise RuntimeError(f"stage {name} failed with exit code {code}")


def stage_data(config: FlywheelRecipe, out: Path) -> dict[str, Any]:
    """The round-1 inputs: the user's files where given (``data.raw_pool``/``data.rl_prompts`` as paths,
    ``eval.suite``), else the built-in task suite's pool, prompts and eval suite; the pretraining corpus
    only when the base model is pretrained here."""
    from posttrain.data.io import write_jsonl, write_records
    from posttrain.eval.items import load_suite
    from posttrain.flywheel.rounds import user_file
    from posttrain.tasks.corpus import pretrain_corpus
    from posttrain.tasks.emit import flywheel_suite, rl_prompts
    from posttrain.tasks.pool import NoiseMix, raw_pool

    spec, counts = config.data, {}
    if isinstance(spec.raw_pool, str):
        raw = user_file(spec.raw_pool, "data.raw_pool")
    else:
        pool = raw_pool(spec.raw_pool, config.seed, noise=NoiseMix(off_topic=spec.off_topic_share),
                        preamble_share=spec.preamble_share, unkeyed_share=spec.unkeyed_share)
        raw = str(out / "raw.jsonl")
        write_jsonl(raw, pool)
        counts["raw"] = len(pool)
    if isinstance(spec.rl_prompts, str):
        prompts = user_file(spec.rl_prompts, "data.rl_prompts")
    else:
        prompts = str(out / "prompts.jsonl")
        write_records(prompts, rl_prompts(spec.rl_prompts, config.seed + 1))
    outputs: dict[str, Any] = {"raw": raw, "prompts": prompts}
    if config.base.model is None:
        corpus = pretrain_corpus(config.base.corpus_documents, config.seed)
        outputs["corpus"] = str(out / "corpus.txt")
        Path(outputs["corpus"]).write_text("\n".join(doc.replace("\n", " ") for doc in corpus) + "\n", encoding="utf-8")
        counts["corpus"] = len(corpus)
    if config.eval.suite:
        outputs["suite"] = user_file(config.eval.suite, "eval.suite")
        counts["eval_items"] = len(load_suite(outputs["suite"]).items)
    else:
        suite = flywheel_suite(n_per_cell=config.eval.n_per_cell, seed=config.seed)
        outputs["suite"] = str(out / "suite.jsonl")
        write_jsonl(outputs["suite"], [item.model_dump(mode="json") for item in suite.items])
        (out / "suite_weights.json").write_text(json.dumps(suite.group_weights))
        counts["eval_items"] = len(suite.items)
    return {**outputs, "counts": counts}


def stage_base(config: FlywheelRecipe, data: dict[str, Any], out: Path) -> dict[str, Any]:
    from posttrain.data.io import iter_jsonl
    from posttrain.models.tiny import build_tiny_model

    if config.base.model is not None:
        from posttrain.flywheel.rounds import user_file

        return {"model": user_file(config.base.model, "base.model"), "metrics": None}
    from posttrain.flywheel.packaged_base import install_packaged_base, matching_packaged_base

    shipped = matching_packaged_base(config, data)
    if shipped is not None:
        return install_packaged_base(shipped, data["corpus"], out)
    corpus = Path(data["corpus"]).read_text(encoding="utf-8").splitlines()
    pool_texts = []
    for _, row in iter_jsonl(data["raw"]):
        pool_texts += [row.get("prompt", ""), row.get("response", "")]
    spec = config.base
    assert spec.pretrain is not None  # the config requires pretrain when there is no base.model
    init = build_tiny_model(
        out / "init",
        texts=corpus + pool_texts,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_layers=spec.layers,
        num_heads=spec.heads,
        num_kv_heads=spec.kv_heads,
        seed=config.seed,
    )
    wiring = {"model.path": str(init), "data.train": data["corpus"], "output_dir": str(out / "pretrain")}
    run_stage_recipe("pretrain", spec.pretrain, wiring)
    return {"model": str(out / "pretrain" / "final"), "metrics": str(out / "pretrain" / "metrics.jsonl")}


def stage_eval(model_path: str, suite_path: str, config: FlywheelRecipe, out: Path, label: str,
               backend: Any = None) -> dict[str, Any]:
    """Greedy eval of ``model_path`` (or an already loaded ``backend``) on a suite → ``out/results.json``."""
    from posttrain.eval.harness import evaluate
    from posttrain.eval.items import load_suite
    from posttrain.generate.engine import HFBackend, SamplingParams

    suite = load_suite(suite_path)
    weights_file = Path(suite_path).with_name("suite_weights.json")
    if weights_file.exists() and not config.eval.suite:
        suite.group_weights = json.loads(weights_file.read_text())
    backend = backend or HFBackend.from_path(model_path)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=config.eval.max_new_tokens, seed=config.seed)
    results = evaluate(
        backend, suite, params, batch_size=config.eval.batch_size, n_boot=config.eval.n_boot,
        seed=config.seed, model_name=label,
    )
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1))
    composite = results["scores"]["composite"]
    return {"results": str(path), "composite": composite["score"], "ci": [composite["ci_low"], composite["ci_high"]]}


def stage_grpo(config: FlywheelRecipe, data: dict[str, Any], model: str, out: Path,
               label: str = "grpo") -> dict[str, Any]:
    """GRPO on the round's RL prompts (``data["prompts"]``) of ``grpo.groups`` (the last ``grpo.eval_prompts``
    held out for the reward curve), starting from ``model``; ``label`` names the stage in messages."""
    from posttrain.data.io import iter_jsonl, write_jsonl

    spec = config.grpo
    assert spec is not None
    rows = [row for _, row in iter_jsonl(data["prompts"]) if row.get("group") in spec.groups]
    held = min(spec.eval_prompts, len(rows) // 4)
    if len(rows) - held < 1:
        raise RuntimeError(f"no RL prompts of groups {spec.groups} in {data['prompts']}; raise data.rl_prompts")
    write_jsonl(str(out / "prompts.jsonl"), rows[: len(rows) - held])
    wiring = {"model.path": model, "data.train": str(out / "prompts.jsonl"), "output_dir": str(out)}
    if held:
        write_jsonl(str(out / "eval_prompts.jsonl"), rows[len(rows) - held :])
        wiring["data.eval"] = str(out / "eval_prompts.jsonl")
    return {**_run_and_list("grpo", spec, wiring, out, label=label), "groups": sorted(spec.groups)}


def stage_dpo(stage: StageRecipe, wiring: dict[str, Any], out: Path, hint: tuple[str, str], label: str = "dpo",
              owner: str | None = None) -> dict[str, Any]:
    """DPO on the round's pairs, or the record of why not (``skipped_dpo``): fewer pairs in ``data.train`` than
    the stage's ``dpo.min_pairs``, counted here or, after tokenisation dropped some, by ``posttrain dpo``."""
    from posttrain.train.pairs import TooFewPairs

    config = stage_config("dpo", label, stage.recipe, stage.overrides, {**wiring, "output_dir": str(out)}, owner)
    pairs, minimum = count_pairs(Path(config.data.train)), config.dpo.min_pairs
    if pairs < minimum:
        return skipped_dpo(pairs, minimum, *hint)
    try:
        run_stage_config("dpo", config)
    except TooFewPairs as exc:
        return skipped_dpo(exc.pairs, minimum, *hint)
    return {"files": sorted(p.name for p in out.iterdir())}


def stage_compare(evals: dict[str, str], config: FlywheelRecipe, out: Path,
                  pairs: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Paired comparisons ``base->new`` of the evaluated models (default: round 1's, each model against the one
    it was trained from, and base against DPO; without DPO, when its stage was skipped)."""
    from posttrain.eval.stats import compare_results

    def load(name: str) -> dict:
        return json.loads(Path(evals[name]).read_text())

    comparisons = {}
    if pairs is None:
        pairs = [("base", "sft")] + ([("sft", "dpo"), ("base", "dpo")] if "dpo" in evals else [])
        if "grpo" in evals:
            pairs.append(("dpo" if "dpo" in evals else "sft", "grpo"))
    for base, new in pairs:
        result = compare_results(load(base), load(new), n_perm=config.eval.n_perm,
                                 seed=config.seed)
        comparisons[f"{base}->{new}"] = result
    path = out / "comparisons.json"
    path.write_text(json.dumps(comparisons, indent=1))
    return {"comparisons": str(path)}


def run_flywheel(config: FlywheelRecipe) -> int:
    if config.threads:
        configure_threads(config.threads)
    resolve_stages(config)  # a stage whose overrides make no valid config stops the run now (exit 2), not mid-round
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    runner = StageRunner(run_dir)
    dump = config.model_dump(mode="json")
    for stage in ("curate", "sft", "sample", "dpo", "grpo"):  # fault-injection drills do not change a result
        if dump.get(stage) is not None:
            dump[stage]["overrides"] = {k: v for k, v in dump[stage]["overrides"].items() if not k.startswith("debug.")}
    try:
        from posttrain.flywheel.rounds import file_fingerprint

        files = {name: file_fingerprint(path, key) for name, key, path in
                 (("raw", "data.raw_pool", config.data.raw_pool), ("prompts", "data.rl_prompts", config.data.rl_prompts),
                  ("suite", "eval.suite", config.eval.suite))
                 if isinstance(path, str)}  # fmt: skip
        if dump["eval"]["suite"] is None:
            dump["eval"].pop("suite")
        data_key = {"seed": config.seed, **dump["data"], "eval": dump["eval"], "docs": config.base.corpus_documents}
        data_key.update({"files": files} if files else {})
        data_key.update({} if config.base.model is None else {"pretrain_here": False})
        for name, default in NEW_DATA_DEFAULTS.items():  # options added later: a default leaves old keys (caches) valid
            if data_key.get(name) == default:
                data_key.pop(name)
        if dump["base"]["model"] is None:
            dump["base"].pop("model")
        if dump["base"]["packaged"]:  # the shipped base is the one pretraining here makes: old caches stay valid
            dump["base"].pop("packaged")
        data = runner.run("data", data_key, [], lambda out: stage_data(config, out))
        base = runner.run("base", dump["base"], ["data"], lambda out: stage_base(config, data, out))
        stages = round_one_stages(config, data, base)

        def recipe_stage(name: str, depends_on: list[str]) -> dict[str, Any]:
            """A stage that runs the registered recipe ``name`` into its own stage directory."""
            stage, wiring = stages[name]
            return runner.run(name, dump[name], depends_on, lambda out: _run_and_list(name, stage, wiring, out))

        recipe_stage("curate", ["data"])
        recipe_stage("sft", ["base", "curate"])
        recipe_stage("sample", ["sft", "data"])
        dpo = recipe_stage("dpo", ["sft", "sample"])
        models = {"base": base["model"], "sft": str(run_dir / "sft" / "final")}
        if dpo.get("skipped"):
            runner.log(f"dpo: no DPO model this round. {dpo['skipped']}")
        else:
            models["dpo"] = str(run_dir / "dpo" / "final")
        if config.grpo is not None and config.grpo.enabled:
            start = round_one_stages(config, data, base, dpo_trained="dpo" in models)["grpo"][1]["model.path"]
            runner.run("grpo", dump["grpo"], ["dpo", "data"], lambda out: stage_grpo(config, data, start, out))
            models["grpo"] = str(run_dir / "grpo" / "final")
        evals = {}
        for label, model_path in models.items():
            result = runner.run(
                f"eval_{label}", {"eval": dump["eval"], "model": label}, ["data", "base" if label == "base" else label],
                lambda out, m=model_path, lab=label: stage_eval(m, data["suite"], config, out, lab),
            )
            evals[label] = result["results"]
        runner.run("compare", dump["eval"], [f"eval_{label}" for label in models],
                   lambda out: stage_compare(evals, config, out))
        if config.rounds > 1:
            _later_rounds(config, runner, run_dir, models, evals, data["suite"])
        from posttrain.flywheel.report import build_report

        report = build_report(run_dir, runner.timings(), tuple(models))
    except StageInterrupted as exc:
        print(f"[flywheel] {exc}", file=sys.stderr)
        return EXIT_RESUMABLE
    print(f"\nreport: {report['html']}\nnumbers: {report['json']}")
    for line in report["summary"]:
        print(line)
    return 0


def _later_rounds(config: FlywheelRecipe, runner: StageRunner, run_dir: Path, models: dict[str, str],
                  evals: dict[str, str], suite: str) -> None:
    """Rounds 2..N, each from the previous round's final model; then ``rounds.json`` for the report."""
    from posttrain.flywheel.rounds import run_next_round, write_rounds_index

    final = list(models)[-1]  # grpo, else dpo, else sft when the DPO stage was skipped
    rounds = [{"round": 1, "dir": ".", "models": list(models), "final": final, "label": f"round1/{final}",
               "model": models[final], "stage": final, "results": evals[final]}]
    for round_index in range(2, config.rounds + 1):
        rounds.append(run_next_round(config, runner, run_dir, round_index, rounds[-1], suite, stage_eval,
                                     stage_compare, _run_and_list))
    write_rounds_index(run_dir, rounds, config, stage_compare)


def _run_and_list(name: str, stage: StageRecipe, wiring: dict[str, Any], out: Path, label: str | None = None,
                  owner: str | None = None, hint: tuple[str, str] = ROUND_ONE_PAIRS_HINT) -> dict[str, Any]:
    """Run stage ``name`` (a DPO stage through ``stage_dpo``); its outputs: the files it wrote."""
    if name == "dpo":
        return stage_dpo(stage, wiring, out, hint, label or name, owner)
    run_stage_recipe(name, stage, wiring, label, owner)
    return {"files": sorted(p.name for p in out.iterdir())}
