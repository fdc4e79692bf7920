"""What a report shows, read from a run's own files as plain numbers (also written as ``report.json``).

Every reader takes a directory or file a posttrain command wrote and returns JSON-able dicts; nothing
here needs the config object that produced the run, so a report can be drawn for any run directory
after the fact. What a reader cannot find it leaves out (``None``), and the page leaves out its section.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from posttrain.config.loader import load_yaml
from posttrain.data.io import BadLine, iter_raw_records

MODEL_ORDER = ("base", "sft", "dpo", "grpo")  # a flywheel round's models in the order they are made
TRAINING_STAGES = ("sft", "dpo", "grpo")  # the stages of a flywheel round whose curves the report draws
FEEDBACK_STAGES = ("capture", "annotate", "export", "feedback")  # round ≥ 2: the loop that feeds it


def read_json(path: Path) -> Any | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def read_lines(path: Path, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """A JSONL log's records. A line that does not parse (the torn last line of a killed run) is skipped
    and counted in ``notes``, so a report of a crashed or running run still draws."""
    if not path.is_file():
        return []
    rows, bad = [], []
    for number, item in iter_raw_records(str(path)):
        if isinstance(item, BadLine):
            if item.raw.strip():
                bad.append(number)
        else:
            rows.append(item)
    if bad and notes is not None:
        notes.append(f"{path.name}: {len(bad)} unreadable line(s) skipped (line {', '.join(map(str, bad[:5]))})")
    return rows


def _per_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training records by step; a step replayed after a rollback or resume keeps its last record."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        if "loss" in row and "step" in row:
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def _column(rows: list[dict[str, Any]], key: str) -> list[Any] | None:
    """``key`` of every row, or ``None`` when no row has it (the series does not exist for this run)."""
    return [r.get(key) for r in rows] if any(key in r for r in rows) else None


def training_series(run_dir: Path, notes: list[str] | None = None) -> dict[str, Any] | None:
    """The curves of one training run (``output_dir`` of sft / pretrain / dpo / rm / grpo): loss, gradient
    norm and learning rate per step; examples drawn per tier; the preference margin and accuracy (DPO
    family: ``rewards/accuracy``, RM: ``accuracy``); GRPO's reward and pass rates, and with ``env:`` its episodes'
    tool-call rate, turns, tool-error and failed shares (``episodes``); the held-out figures
    logged every ``train.eval_every`` (``eval``) and before / after training (``eval.json``)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = read_lines(path, notes)
    steps = _per_step(rows)
    series: dict[str, Any] = {"step": [r["step"] for r in steps]}
    for key, name in (("loss", "loss"), ("grad_norm", "grad_norm"), ("lr", "lr"), ("rewards/margin", "margin"),
                      ("rewards/accuracy", "accuracy"), ("accuracy", "accuracy"), ("reward_mean", "reward"),
                      ("pass@1", "pass@1")):
        column = _column(steps, key)
        if column is not None and name not in series:
            series[name] = column
    tier_keys = sorted({k for r in steps for k in r if k.startswith("tier_")})
    if tier_keys:
        series["tiers"] = {k: [r.get(k, 0) for r in steps] for k in tier_keys}
    moe = _expert_load(steps)
    if moe:
        series["moe"] = moe
    episode_keys = ("episode/tool_call_rate", "episode/turns_mean", "episode/tool_error_share", "episode/failed_share")
    if any(k in r for r in steps for k in episode_keys):  # GRPO with env: (docs/agentic.md)
        series["episodes"] = {k.removeprefix("episode/"): [r.get(k) for r in steps] for k in episode_keys}
    pass_keys = sorted({k for r in steps for k in r if k.startswith("pass@1/tier_")})
    if pass_keys:
        series["pass_by_tier"] = {k.removeprefix("pass@1/"): [r.get(k) for r in steps] for k in pass_keys}
    # Held-out figures during training; the before / after lines (eval_phase) are the table's, not a curve's.
    evals = [r for r in rows if "loss" not in r and "eval_phase" not in r and any(k.startswith("eval/") for k in r)]
    if evals:
        keys = sorted({k for r in evals for k in r if k.startswith("eval/")})
        series["eval"] = {"step": [r["step"] for r in evals],
                          **{k.removeprefix("eval/"): [r.get(k) for r in evals] for k in keys}}
    phases = read_json(run_dir / "eval.json")
    if phases:
        series["eval_phases"] = phases
    return series


def _expert_load(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A mixture of experts' load per MoE layer and step (``moe/layer<i>/…``, ``posttrain.train.router``): the
    busiest expert's tokens over the mean (1 = perfectly balanced) and the load's normalised entropy."""
    layers = sorted({int(k.split("/")[1].removeprefix("layer")) for r in steps for k in r
                     if k.startswith("moe/layer") and k.endswith("/load_max")})
    if not layers:
        return None

    def ratio(row: dict[str, Any], layer: int) -> float | None:
        top, mean = row.get(f"moe/layer{layer}/load_max"), row.get(f"moe/layer{layer}/load_mean")
        return top / mean if isinstance(top, int | float) and isinstance(mean, int | float) and mean > 0 else None

    return {"layers": layers,
            "max_over_mean": [[ratio(r, layer) for r in steps] for layer in layers],
            "entropy": [[r.get(f"moe/layer{layer}/load_entropy") for r in steps] for layer in layers],
            "aux_loss": _column(steps, "moe/aux_loss"), "z_loss": _column(steps, "moe/z_loss")}


def training_run(run_dir: Path) -> dict[str, Any]:
    """A training run directory: its recipe, model, data and length (``config.yaml``, ``finished.json``),
    its curves and its alerts."""
    notes: list[str] = []
    config = {}
    config_file = run_dir / "config.yaml"
    if config_file.is_file():
        config = load_yaml(config_file.read_text(encoding="utf-8"), str(config_file)) or {}
    finished = read_json(run_dir / "finished.json") or {}
    alerts = read_lines(run_dir / "alerts.jsonl", notes)
    series = training_series(run_dir, notes) or {"step": []}
    return {
        "kind": config.get("recipe") or "training",
        "run_dir": str(run_dir),
        "model": (config.get("model") or {}).get("path"),
        "data": (config.get("data") or {}).get("train"),
        "finished": {k: finished[k] for k in ("steps", "export") if k in finished} or None,
        "series": series,
        "alerts": [{k: v for k, v in a.items() if k != "time"} for a in alerts],
        "notes": notes,
    }


def curation_output(out_dir: Path) -> dict[str, Any]:
    """A ``posttrain curate`` (or ``sample``) output directory: the funnel, the lineage of the manifest,
    and the tier mix of the kept records."""
    manifest = read_json(out_dir / "manifest.json") or {}
    funnel = read_json(out_dir / "funnel.json") or manifest.get("funnel")
    tiers: Counter = Counter()
    notes: list[str] = []
    for row in read_lines(out_dir / "kept.jsonl", notes):
        tiers[str(row.get("tier", "none"))] += 1
    return {
        "kind": manifest.get("kind") or "curate",
        "run_dir": str(out_dir),
        "funnel": funnel,
        "lineage": {k: manifest[k] for k in ("dataset_id", "content_hash", "config_hash", "posttrain_version")
                    if k in manifest},
        "parents": manifest.get("parents", []),
        "kept_tiers": dict(sorted(tiers.items())),
        "notes": notes,
    }


def is_eval_results(data: Any) -> bool:
    """A ``posttrain eval -o`` file: scored items and the scores computed from them."""
    return isinstance(data, dict) and isinstance(data.get("items"), list) and isinstance(data.get("scores"), dict)


def is_comparison(data: Any) -> bool:
    """A ``posttrain eval compare -o`` file (one comparison)."""
    return isinstance(data, dict) and isinstance(data.get("composite"), dict) and "summary" in data


def is_comparison_set(data: Any) -> bool:
    """Named comparisons in one file (a flywheel's ``compare/comparisons.json``, ``across/comparisons.json``)."""
    return isinstance(data, dict) and bool(data) and all(is_comparison(v) for v in data.values())


def eval_scores(results: dict[str, Any]) -> dict[str, Any]:
    """The part of an eval results file a report shows: scores (with CIs), counts, suite and model."""
    return {"scores": results["scores"], "counts": results.get("counts", {}), "suite": results.get("suite"),
            "model": results.get("model")}


def slim_comparison(result: dict[str, Any]) -> dict[str, Any]:
    return {key: result[key] for key in ("composite", "groups", "tiers", "summary") if key in result}


def eval_output(path: Path) -> dict[str, Any]:
    """An eval results file, or a directory of them (``results.json`` or several ``*.json`` side by side,
    with any ``posttrain eval compare -o`` files among them)."""
    files = [path] if path.is_file() else sorted(path.glob("*.json"))
    models, comparisons = {}, {}
    for file in files:
        data = read_json(file)
        label = file.parent.name if file.name == "results.json" else file.stem
        if is_eval_results(data):
            models[label] = eval_scores(data)
        elif is_comparison(data):
            comparisons[label] = slim_comparison(data)
        elif is_comparison_set(data):
            comparisons.update({name: slim_comparison(result) for name, result in data.items()})
    return {"kind": "eval", "run_dir": str(path), "models": list(models),
            "scores": {m: s["scores"] for m, s in models.items()},
            "results": {m: {k: v for k, v in s.items() if k != "scores"} for m, s in models.items()},
            "comparisons": comparisons}


def stage_outputs(stage_dir: Path) -> dict[str, Any] | None:
    saved = read_json(stage_dir / "stage.json")
    return saved.get("outputs") if isinstance(saved, dict) else None


def stage_timings(run_dir: Path) -> dict[str, float]:
    """Seconds per finished stage, from each stage's ``stage.json`` (``posttrain.flywheel.stages``)."""
    timings = {}
    for marker in sorted(run_dir.glob("*/stage.json"), key=lambda p: p.stat().st_mtime):
        saved = read_json(marker)
        if isinstance(saved, dict) and "seconds" in saved:
            timings[marker.parent.name] = round(float(saved["seconds"]), 2)
    return timings


def round_models(round_dir: Path) -> list[str]:
    """The models a round evaluated (``eval_<model>/results.json``), in the order a round makes them."""
    found = {p.parent.name.removeprefix("eval_") for p in round_dir.glob("eval_*/results.json")}
    return [m for m in MODEL_ORDER if m in found] + sorted(found - set(MODEL_ORDER))


def _numbers(outputs: dict[str, Any]) -> dict[str, Any]:
    """The counts a feedback stage reports: its top-level numbers and those of its ``counts``."""
    flat = {k: v for k, v in outputs.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    counts = outputs.get("counts")
    if isinstance(counts, dict):
        flat.update({k: v for k, v in counts.items() if isinstance(v, int | float) and not isinstance(v, bool)})
    return flat


# What each training stage of a round learns from, for the report's "what each stage targeted" table. SFT and
# DPO learn from every group, so their target is the composite; GRPO's is the groups of its prompts.
STAGE_DATA = {"sft": "the curated SFT records (every group)",
              "dpo": "preference pairs of its own sampled answers, right over wrong by the verifier (every group)"}


def stage_targets(round_dir: Path, comparisons: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Comparison name → ``{"stage", "trained_on", "groups"}`` for each comparison of a stage with the model it
    started from (``groups``: the measures that stage is judged on; ``None``: the composite). The cumulative
    comparisons (``base->dpo``, ``start->grpo``…) are not one stage's, and a GRPO stage that did not record its
    groups (runs before they were recorded) is left out."""
    targets = {}
    for name in comparisons:
        before, _, stage = name.partition("->")
        if before in ("base", "start") and stage != "sft":
            continue
        if stage == "grpo":
            groups = (stage_outputs(round_dir / "grpo") or {}).get("groups")
            if groups:
                targets[name] = {"stage": stage, "groups": list(groups),
                                 "trained_on": f"RL prompts of {', '.join(groups)} with the verifier reward"}
        elif stage in STAGE_DATA:
            targets[name] = {"stage": stage, "groups": None, "trained_on": STAGE_DATA[stage]}
    return targets


def flywheel_round(round_dir: Path, models: list[str] | None = None) -> dict[str, Any]:
    """One flywheel round's directory: its funnels, the curves of its training stages, the scores of its
    models and their paired comparisons, the stage times, (round ≥ 2) the feedback stages' counts, and the
    training stages that did not train, with why (``skipped``: a DPO stage below ``dpo.min_pairs``)."""
    notes: list[str] = []
    if isinstance(base := stage_outputs(round_dir / "base"), dict) and base.get("packaged"):
        notes.append(f"base model: {base['packaged']}")  # not pretrained in this run: say so where it is read
    skipped = {stage: outputs["skipped"] for stage in TRAINING_STAGES
               if isinstance(outputs := stage_outputs(round_dir / stage), dict) and outputs.get("skipped")}
    models = list(models) if models else round_models(round_dir)
    models = [m for m in models if m not in skipped]  # an eval_<stage> left from an earlier run that did train
    evals = {m: read_json(round_dir / f"eval_{m}" / "results.json") for m in models}
    models = [m for m in models if evals[m] is not None]
    comparisons = read_json(round_dir / "compare" / "comparisons.json") or {}
    curate = read_json(round_dir / "curate" / "funnel.json")
    data: dict[str, Any] = {
        "funnel": curate,
        "sample_funnel": read_json(round_dir / "sample" / "funnel.json"),
    }
    for stage in TRAINING_STAGES:
        data[stage] = None if stage in skipped else training_series(round_dir / stage, notes)
    feedback = {stage: _numbers(outputs) for stage in FEEDBACK_STAGES
                if (outputs := stage_outputs(round_dir / stage)) is not None}
    data.update({
        "models": models,
        "scores": {m: evals[m]["scores"] for m in models},
        "comparisons": {name: slim_comparison(result) for name, result in comparisons.items()},
        "targets": stage_targets(round_dir, comparisons),
        "timings_s": stage_timings(round_dir),
        "feedback": feedback or None,
        "skipped": skipped,
        "notes": notes,
    })
    return data


def rounds_index(run_dir: Path) -> dict[str, Any] | None:
    """``rounds.json`` of a multi-round flywheel run, or ``None`` for a one-round run."""
    return read_json(run_dir / "rounds.json")


def flywheel_run(run_dir: Path, models: list[str] | None = None) -> dict[str, Any]:
    """A flywheel run directory. Round 1's figures stay at the top level (as a one-round report has them);
    with ``rounds.json`` every round is under ``rounds`` (its entry of ``rounds.json`` plus its figures and
    its final model's scores) and the across-rounds comparisons under ``across``."""
    data = {"kind": "flywheel", "run_dir": str(run_dir), **flywheel_round(run_dir, models)}
    index = rounds_index(run_dir)
    if not index:
        return data
    rounds = []
    for entry in index.get("rounds", []):
        round_dir = run_dir / entry.get("dir", ".")
        figures = data if round_dir.resolve() == run_dir.resolve() else flywheel_round(round_dir, entry.get("models"))
        final = entry.get("final") or (figures["models"][-1] if figures["models"] else None)
        rounds.append({**entry, "final": final, "final_scores": figures["scores"].get(final),
                       "figures": {k: v for k, v in figures.items() if k not in ("kind", "run_dir")}})
    across = read_json(run_dir / index["across"]) if index.get("across") else None
    data["rounds"] = rounds
    data["across"] = {name: slim_comparison(r) for name, r in (across or {}).items()}
    return data
