"""Assemble the page for each kind of run directory (see ``posttrain.report.detect``)."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from posttrain.report import collect, figures, tables
from posttrain.report.page import Page
from posttrain.report.tables import esc

STAGE_LABELS = {"sft": "SFT", "dpo": "DPO", "grpo": "GRPO", "pretrain": "pretraining", "rm": "reward model"}


def _notes(notes: list[str]) -> str:
    return "".join(f"<p><small>note: {esc(n)}</small></p>" for n in notes)


def _scores_body(scores: dict[str, Any], comparisons: dict[str, Any],
                 marked: dict[str, set[str]] | None = None, skipped: dict[str, str] | None = None,
                 targets: dict[str, Any] | None = None) -> str:
    # A stage that did not train has no model to score: say why where its comparison would be.
    body = "".join(f'<p class="skipped"><b>{esc(why)}</b></p>' for why in (skipped or {}).values())
    body += tables.scores_table(scores) if scores else ""
    targeted = tables.targets_table(targets or {}, comparisons)
    if targeted:
        body += ("<h4>What each stage targeted</h4><p>Each training stage against the model it started from, on the "
                 "measure it is for: the composite for stages that learn from every group, the groups of its prompts "
                 "for GRPO.</p>" + targeted)
    if comparisons:
        body += "<h4>Paired comparisons</h4>" + tables.comparisons_table(comparisons, marked)
        body += tables.reading_the_verdicts()
    return body


# ------------------------------------------------------------------------------------------ training runs


def _training_sections(page: Page, series: dict[str, Any] | None, label: str, prefix: str, level: int) -> None:
    body = ""
    phases = (series or {}).get("eval_phases")
    if phases:
        keys = sorted({k for phase in phases.values() for k in phase})
        body = "<p>Held-out set before and after training:</p>" + tables.table(
            ["", *map(esc, phases)], [[esc(k), *(esc(_fmt(phase.get(k))) for phase in phases.values())] for k in keys])
    page.add(label, body, figures.training_figures(series, label, prefix), level=level)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _shown(data: dict[str, Any], shown_as: str | None) -> dict[str, Any]:
    """A remote run's URL in place of the local copy's directory it was fetched into (``report.remote``)."""
    if shown_as:
        data["run_dir"] = shown_as
    return data


def training_page(run_dir: Path, shown_as: str | None = None) -> tuple[Page, dict[str, Any]]:
    data = _shown(collect.training_run(run_dir), shown_as)
    label = STAGE_LABELS.get(data["kind"], data["kind"])
    finished = data["finished"] or {}
    facts = {"recipe": data["kind"], "run directory": data["run_dir"], "model": data["model"],
             "training data": data["data"],
             "steps": finished.get("steps", f"{len(data['series']['step'])} logged (not finished)"),
             "export": finished.get("export") and posixpath.join(data["run_dir"], finished["export"])}
    page = Page(f"posttrain {label} run", tables.key_values(facts) + _notes(data["notes"]))
    _training_sections(page, data["series"], label, data["kind"], 2)
    if data["alerts"]:
        rows = [[esc(a.get("kind")), esc(a.get("step", "")),
                 esc(a.get("message") or ", ".join(f"{k}={v}" for k, v in a.items() if k not in ("kind", "step")))]
                for a in data["alerts"]]
        page.add(f"Alerts ({len(rows)})", tables.table(["kind", "step", "what"], rows))
    return page, data


# ------------------------------------------------------------------------------------------ curate / sample


def curate_page(out_dir: Path, shown_as: str | None = None) -> tuple[Page, dict[str, Any]]:
    data = _shown(collect.curation_output(out_dir), shown_as)
    funnel = data["funnel"]
    facts = {"output directory": data["run_dir"], **data["lineage"],
             "parents": ", ".join(p.get("path", "?") for p in data["parents"])}
    page = Page(f"posttrain {data['kind']} output", tables.key_values(facts) + _notes(data["notes"]))
    extras = {k: v for k, v in funnel.items() if isinstance(v, dict) and k != "stages"}
    body = tables.funnel_table(funnel) + "".join(
        f"<h4>{esc(k)}</h4>" + tables.key_values(v) for k, v in extras.items())
    page.add("Funnel", body, [("funnel", figures.funnel_figure(funnel, f"{data['kind'].capitalize()} funnel"))])
    if data["kept_tiers"]:
        page.add("Kept records by tier", tables.table(["tier", "records"],
                                                      [[esc(t), esc(n)] for t, n in data["kept_tiers"].items()]))
    return page, data


# ------------------------------------------------------------------------------------------ eval results


def eval_page(path: Path, shown_as: str | None = None) -> tuple[Page, dict[str, Any]]:
    data = _shown(collect.eval_output(path), shown_as)
    counts = {m: r.get("counts", {}) for m, r in data["results"].items()}
    facts = {"results": data["run_dir"], **{
        f"{m}": f"suite {r.get('suite')}, {counts[m].get('passed', '?')}/{counts[m].get('items', '?')} items passed"
        for m, r in data["results"].items()}}
    page = Page("posttrain eval results", tables.key_values(facts))
    scores = data["scores"]
    charts = []
    if scores:
        charts.append(("scores", figures.scores_figure(scores)))
        if any(s.get("tiers") for s in scores.values()):
            charts.append(("scores-tiers", figures.scores_figure(scores, "tiers")))
    body = _scores_body(scores, data["comparisons"])
    if scores:
        body += "<h4>By tier</h4>" + tables.tiers_table(scores)
    page.add("Scores", body, charts)
    return page, data


# ------------------------------------------------------------------------------------------ flywheel runs


def _round_sections(page: Page, data: dict[str, Any], prefix: str, level: int) -> None:
    """A round's own report: its scores and comparisons, funnel, feedback counts, training curves."""
    charts = [(f"{prefix}scores", figures.scores_figure(data["scores"]))] if data["scores"] else []
    page.add("Scores", _scores_body(data["scores"], data["comparisons"], skipped=data.get("skipped"),
                                    targets=data.get("targets")), charts, level=level)
    if data.get("feedback"):
        rows = [[esc(stage), esc(", ".join(f"{k} {v}" for k, v in counts.items()) or "–")]
                for stage, counts in data["feedback"].items()]
        page.add("Feedback from the previous round", tables.table(["stage", "counts"], rows), level=level)
    if data.get("funnel"):
        body = tables.funnel_table(data["funnel"])
        sample = data.get("sample_funnel") or {}
        if sample.get("pairs"):
            body += "<p>Rejection sampling: " + esc(", ".join(f"{k} {v}" for k, v in sample["pairs"].items())) + "</p>"
        page.add("Curation", body, [(f"{prefix}funnel", figures.funnel_figure(data["funnel"]))], level=level)
    for stage in collect.TRAINING_STAGES:
        _training_sections(page, data.get(stage), STAGE_LABELS[stage], f"{prefix}{stage}", level)
    if data.get("notes"):
        page.add("Notes", _notes(data["notes"]), level=level)


def _captured_marks(rounds: list[dict[str, Any]], across: dict[str, Any]) -> dict[str, set[str]]:
    """For each across-rounds comparison, the groups whose edge cases the newer round was trained on."""
    by_round = {str(r["round"]): set(r.get("captured_groups") or []) for r in rounds}
    marks = {}
    for name in across:
        found = re.findall(r"round(\d+)", name.split("->")[-1])
        marks[name] = by_round.get(found[0], set()) if found else set()
    return marks


def _rounds_summary(page: Page, data: dict[str, Any]) -> None:
    rounds = data["rounds"]
    captured = {g for r in rounds for g in (r.get("captured_groups") or [])}
    finals = {f"round {r['round']} ({r['final']})": r["final_scores"] for r in rounds if r.get("final_scores")}
    body = "<p>The final model of each round, side by side (score with its 95% bootstrap CI; ★ marks the " \
           "groups the captured edge cases came from).</p>" + tables.scores_table(finals, captured)
    count_keys = sorted({k for r in rounds for k in (r.get("counts") or {})})
    rows = [[f"round {esc(r['round'])}", esc(r.get("dir", ".")), esc(", ".join(r.get("models", []))),
             esc(r.get("final")), esc(", ".join(r.get("captured_groups") or []) or "–"),
             *(esc((r.get("counts") or {}).get(k, "–")) for k in count_keys)] for r in rounds]
    body += "<h4>What each round trained on</h4>" + tables.table(
        ["round", "directory", "models", "final", "captured groups", *map(esc, count_keys)], rows)
    if data.get("across"):
        body += "<h4>Across rounds</h4>" + tables.comparisons_table(data["across"],
                                                                    _captured_marks(rounds, data["across"]))
        body += tables.reading_the_verdicts()
    charts = [("rounds-scores", figures.scores_figure(finals, title="Final model of each round (0–100, 95% CIs)"))
              ] if finals else []
    page.add("Rounds", body, charts)


def flywheel_page(run_dir: Path, timings: dict[str, float] | None = None, models: list[str] | None = None,
                  shown_as: str | None = None) -> tuple[Page, dict[str, Any]]:
    data = _shown(collect.flywheel_run(run_dir, models), shown_as)
    if timings:
        data["timings_s"] = timings
    data["summary"] = list((data.get("skipped") or {}).values())
    data["summary"] += [f"{name}: {line}" for name, comparison in data["comparisons"].items()
                        for line in comparison.get("summary", [])]
    data["summary"] += [f"round {entry['round']}: {why}" for entry in (data.get("rounds") or [])[1:]
                        for why in (entry["figures"].get("skipped") or {}).values()]
    data["summary"] += [f"{name}: {line}" for name, comparison in (data.get("across") or {}).items()
                        for line in comparison.get("summary", [])]
    data["reading_the_verdicts"] = tables.READING_THE_VERDICTS
    timing_text = ", ".join(f"{k} {v:.0f}s" for k, v in data["timings_s"].items())
    intro = (f"<p>Run directory <code>{esc(data['run_dir'])}</code>. "
             f"Stage times: {esc(timing_text or 'none recorded')}.</p>")
    if not data.get("rounds"):
        page = Page("posttrain flywheel round", intro)
        _round_sections(page, data, "", 2)
        return page, data
    page = Page(f"posttrain flywheel: {len(data['rounds'])} rounds", intro)
    _rounds_summary(page, data)
    for entry in data["rounds"]:
        page.add(f"Round {entry['round']}", f"<p>Directory <code>{esc(entry.get('dir', '.'))}</code>; final model "
                 f"{esc(entry['final'])}.</p>", level=2, css="round")
        _round_sections(page, entry["figures"], f"r{entry['round']}-", 3)
    return page, data
