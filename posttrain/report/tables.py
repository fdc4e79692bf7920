"""The report's HTML tables: scores with CIs, paired comparisons (Δ, CI, p, verdict), funnels, counts.

Every cell is escaped: run directories hold user text (paths, stage names, alert messages).
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

from posttrain.eval.stats import format_points, verdict_kind

# How to read the comparison table (the same rules as `posttrain eval compare`), shown folded under it.
READING_THE_VERDICTS = (
    "Each change comes with the confidence interval that inverts its own paired permutation test, so an "
    "interval that excludes 0 is always called significant and one that includes 0 never is. The composite "
    "index is the one primary test (95% CI, raw p). Group and tier intervals are simultaneous: each is built "
    "at 1 - 0.05/m for the m groups (or tiers), so together they hold with 95% confidence, next to "
    "Bonferroni-adjusted p-values. \"Too few items to tell\" means so few items changed that no outcome could "
    "have been significant: more items are needed, not a better model. A warning (⚠) marks an interval from "
    "one item or of zero width (every item changed alike). The bars in the score charts are each model's own "
    "score with a bootstrap CI; judge a change by its paired interval here, not by whether two bars overlap."
)


def esc(value: Any) -> str:
    return html.escape(str(value))


def table(head: Iterable[str] | None, rows: Iterable[Iterable[str]], css: str = "") -> str:
    """A table from already-escaped cells (``<td>`` each, ``<th>`` for the first); no header row for ``None``."""
    head_html = "<thead><tr>" + "".join(f"<th>{cell}</th>" for cell in head) + "</tr></thead>" if head else ""
    body = "".join("<tr>" + "".join(f"<th>{c}</th>" if i == 0 else f"<td>{c}</td>" for i, c in enumerate(row))
                   + "</tr>" for row in rows)
    return f'<table class="{css}">{head_html}<tbody>{body}</tbody></table>'


def score_cell(score: dict[str, Any] | None) -> str:
    if not score:
        return "–"
    return f"{score['score']:.1f} <small>[{score['ci_low']:.1f}, {score['ci_high']:.1f}]</small>"


def scores_table(scores: dict[str, dict[str, Any]], marked: set[str] = frozenset()) -> str:
    """Rows: each group, then the composite; columns: the models (or rounds). ``marked`` groups get ★."""
    groups = sorted({g for s in scores.values() for g in s.get("groups", {})})
    rows = []
    for group in [*groups, "composite"]:
        name = esc(group) + (' <span class="mark" title="captured edge cases came from this group">★</span>'
                             if group in marked else "")
        cells = [score_cell(s["composite"] if group == "composite" else s.get("groups", {}).get(group))
                 for s in scores.values()]
        rows.append([f"<b>{name}</b>" if group == "composite" else name, *cells])
    return table(["", *map(esc, scores)], rows, "scores")


def tiers_table(scores: dict[str, dict[str, Any]]) -> str:
    tiers = sorted({t for s in scores.values() for t in s.get("tiers", {})}, key=str)
    rows = [[f"tier {esc(t)}", *(score_cell(s.get("tiers", {}).get(t)) for s in scores.values())] for t in tiers]
    return table(["", *map(esc, scores)], rows, "scores") if rows else ""


def verdict(test: dict[str, Any]) -> tuple[str, str]:
    """A short verdict for a table cell and its CSS class, from ``eval.stats.verdict_kind`` (the same rule as
    ``summarize_comparison``'s sentences)."""
    kind = verdict_kind(test)
    if kind in ("improvement", "regression"):
        return f"significant {kind}", "up" if kind == "improvement" else "down"
    if kind == "no_change":
        return "no change on any item", "flat"
    if kind == "too_few_items":
        return f"too few items to tell ({test['n_changed']} changed, ≥ {test.get('items_needed')} needed)", "few"
    return "not significant", "flat"


def _comparison_row(name: str, scope: str, test: dict[str, Any], mark: bool) -> list[str]:
    simultaneous = test.get("family_size", 1) > 1
    p = test.get("p_adjusted") if simultaneous else test.get("p_value")
    label, css = verdict(test)
    warnings = test.get("warnings") or []
    warning = f' <span title="{esc("; ".join(warnings))}">⚠</span>' if warnings else ""
    level = f"{1 - test.get('level', 0.05):.0%}" if not simultaneous else "simultaneous"
    scope_html = esc(scope) + (' <span class="mark" title="captured edge cases came from this group">★</span>'
                               if mark else "")
    return [
        esc(name), f"<b>{scope_html}</b>" if scope == "composite" else scope_html,
        f"{test['base']:.1f} → {test['new']:.1f}",
        format_points(test["delta"]),
        f'<span title="{esc(level)}">[{format_points(test["ci_low"])}, {format_points(test["ci_high"])}]</span>',
        "–" if p is None else f"{p:.4f}" + ("*" if simultaneous else ""),
        f'<span class="verdict {css}">{esc(label)}</span>{warning}',
    ]


def comparisons_table(comparisons: dict[str, dict[str, Any]], marked: dict[str, set[str]] | None = None) -> str:
    """One row per measure of each comparison: base → new, Δ, CI, p, verdict; the composite and groups first,
    the tiers in a folded table under it. ``marked[name]`` are the groups of comparison ``name`` to flag (★)."""
    main, by_tier = [], []
    for name, result in comparisons.items():
        flagged = (marked or {}).get(name, set())
        rows = [_comparison_row(name, "composite", result["composite"], False)]
        rows += [_comparison_row(name, f"group {g}", t, g in flagged) for g, t in result.get("groups", {}).items()]
        tiers = [_comparison_row(name, f"tier {k}", t, False) for k, t in result.get("tiers", {}).items()]
        for block, target in ((rows, main), (tiers, by_tier)):
            for index, row in enumerate(block):  # the comparison's name once, on its first row
                target.append(row if index == 0 else ["", *row[1:]])
    if not main:
        return ""
    head = ["comparison", "measure", "score", "Δ (points)", "CI", "p", "verdict"]
    note = "<p><small>* Bonferroni-adjusted over the family (groups or tiers); their CIs are simultaneous.</small></p>"
    tiers_html = (f"<details><summary>By tier ({len(by_tier)} rows)</summary>{table(head, by_tier, 'comparisons')}"
                  "</details>") if by_tier else ""
    return table(head, main, "comparisons") + tiers_html + note


def targets_table(targets: dict[str, dict[str, Any]], comparisons: dict[str, dict[str, Any]]) -> str:
    """One row per training stage and measure it is judged on (the composite, or the groups its prompts came
    from): what it learned from, then that measure's row of the comparisons table — whether the stage did what
    it is for."""
    rows = []
    for name, target in targets.items():
        result = comparisons.get(name) or {}
        measures = [("composite", result.get("composite"))] if target["groups"] is None else [
            (f"group {g}", (result.get("groups") or {}).get(g)) for g in target["groups"]]
        rows += [[esc(target["stage"].upper()), esc(target["trained_on"]), *_comparison_row(name, scope, test, False)]
                 for scope, test in measures if test is not None]
    if not rows:
        return ""
    return table(["stage", "trained on", "comparison", "measure", "score", "Δ (points)", "CI", "p", "verdict"], rows,
                 "comparisons")


def reading_the_verdicts() -> str:
    return (f'<details id="reading-verdicts"><summary>How to read the comparisons</summary>'
            f"<p>{esc(READING_THE_VERDICTS)}</p></details>")


def funnel_table(funnel: dict[str, Any]) -> str:
    rows = [[esc(s["stage"]), esc(s.get("in", "")), esc(s["kept"]),
             esc(", ".join(f"{k} {v}" for k, v in s["dropped"].items()) or "–")] for s in funnel["stages"]]
    return table(["stage", "in", "kept", "dropped (reason count)"], rows, "funnel")


def key_values(pairs: dict[str, Any]) -> str:
    return table(None, [[esc(k), esc(v)] for k, v in pairs.items() if v not in (None, "", [], {})], "kv")
