"""The flywheel report: one self-contained ``report.html`` (plotly.js inlined, no network) + ``report.json``.

Charts: the curation funnel, the tier mix over SFT steps, loss and grad-norm curves for SFT and
DPO, DPO reward margin and preference accuracy, the GRPO reward curve and pass rate by tier (when the
round ran GRPO), and the score jump per capability and composite with 95% CI bars. A small script at the end of the page records JavaScript errors and checks that
every chart drew data (``#render-check``), so a headless browser test can read the verdict.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from posttrain.data.io import read_jsonl

MODELS = ("base", "sft", "dpo")  # every round; "grpo" joins them when the round ran its GRPO stage
# How to read the comparison lines under the score table (the same rules as `posttrain eval compare`).
READING_THE_VERDICTS = (
    "How to read these lines: each change comes with the confidence interval that inverts its own paired "
    "permutation test, so an interval that excludes 0 is always called significant and one that includes 0 "
    "never is. The composite index is the one primary test (95% CI, raw p). Group and tier intervals are "
    "simultaneous: each is built at 1 - 0.05/m for the m groups (or tiers), so together they hold with 95% "
    "confidence, next to Bonferroni-adjusted p-values. \"Too few items to tell\" means so few items changed "
    "that no outcome could have been significant: more items are needed, not a better model. A warning marks "
    "an interval from one item or of zero width (every item changed alike). The bars in the score chart are "
    "each model's own score with a bootstrap CI; judge a change by its paired interval here, not by whether "
    "two bars overlap."
)
COLORS = {"base": "#9aa5b1", "sft": "#3d7ddb", "dpo": "#e0662b", "grpo": "#2a9d5c"}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(str(path)) if path.exists() else []


def _steps(path: Path) -> list[dict[str, Any]]:
    """Per-step training records; a step replayed after a rollback or resume keeps its last record."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in _read_jsonl(path):
        if "loss" in row:
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def _grpo_series(run_dir: Path) -> dict[str, Any] | None:
    """The GRPO stage's curves: reward and pass rates per step (by tier too) and the held-out reward."""
    path = run_dir / "grpo" / "metrics.jsonl"
    if not path.exists():
        return None
    rows = _read_jsonl(path)
    steps = _steps(path)
    evals = [r for r in rows if "eval/reward" in r]
    tier_keys = sorted({k for r in steps for k in r if k.startswith("pass@1/tier_")})
    return {
        "step": [r["step"] for r in steps],
        "reward": [r.get("reward_mean") for r in steps],
        "pass@1": [r.get("pass@1") for r in steps],
        "tiers": {k.removeprefix("pass@1/"): [r.get(k) for r in steps] for k in tier_keys},
        "eval_step": [r["step"] for r in evals],
        "eval_reward": [r["eval/reward"] for r in evals],
        "eval_pass@1": [r.get("eval/pass@1") for r in evals],
    }


def collect(run_dir: Path, models: tuple[str, ...] = MODELS) -> dict[str, Any]:
    """Everything the report shows, as plain numbers (also written as report.json)."""
    evals = {m: json.loads((run_dir / f"eval_{m}" / "results.json").read_text()) for m in models}
    comparisons = json.loads((run_dir / "compare" / "comparisons.json").read_text())
    funnel_path = run_dir / "curate" / "funnel.json"
    sample_funnel = run_dir / "sample" / "funnel.json"
    sft, dpo = _steps(run_dir / "sft" / "metrics.jsonl"), _steps(run_dir / "dpo" / "metrics.jsonl")
    tier_keys = sorted({k for row in sft for k in row if k.startswith("tier_")})
    return {
        "funnel": json.loads(funnel_path.read_text()) if funnel_path.exists() else None,
        "sample_funnel": json.loads(sample_funnel.read_text()) if sample_funnel.exists() else None,
        "sft": {
            "step": [r["step"] for r in sft],
            "loss": [r["loss"] for r in sft],
            "grad_norm": [r["grad_norm"] for r in sft],
            "tiers": {k: [r.get(k, 0) for r in sft] for k in tier_keys},
        },
        "dpo": {
            "step": [r["step"] for r in dpo],
            "loss": [r["loss"] for r in dpo],
            "grad_norm": [r["grad_norm"] for r in dpo],
            "margin": [r.get("rewards/margin") for r in dpo],
            "accuracy": [r.get("rewards/accuracy") for r in dpo],
        },
        "grpo": _grpo_series(run_dir) if "grpo" in models else None,
        "models": list(models),
        "scores": {m: evals[m]["scores"] for m in models},
        "comparisons": {
            name: {key: result[key] for key in ("composite", "groups", "tiers", "summary") if key in result}
            for name, result in comparisons.items()
        },
    }


def _figures(data: dict[str, Any]) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figures = []
    if data["funnel"]:
        stages = data["funnel"]["stages"]
        fig = go.Figure()
        fig.add_bar(name="kept", x=[s["stage"] for s in stages], y=[s["kept"] for s in stages], marker_color="#3d7ddb")
        fig.add_bar(
            name="dropped", x=[s["stage"] for s in stages], y=[sum(s["dropped"].values()) for s in stages],
            marker_color="#e0662b",
            hovertext=[", ".join(f"{k}={v}" for k, v in s["dropped"].items()) or "none" for s in stages],
        )
        fig.update_layout(barmode="stack", title=f"Curation funnel: {data['funnel']['input']} in → {data['funnel']['kept']} kept")
        figures.append(("funnel", fig))

    sft = data["sft"]
    fig = go.Figure()
    for key, counts in sft["tiers"].items():
        fig.add_scatter(x=sft["step"], y=counts, name=key.replace("_", " "), stackgroup="tiers", mode="lines")
    fig.update_layout(title="Tier mix per SFT step (examples drawn)", xaxis_title="step", yaxis_title="examples")
    figures.append(("tiers", fig))

    fig = make_subplots(rows=1, cols=2, subplot_titles=("loss", "gradient norm"))
    for name, series in (("SFT", data["sft"]), ("DPO", data["dpo"])):
        fig.add_scatter(x=series["step"], y=series["loss"], name=f"{name} loss", row=1, col=1, mode="lines")
        fig.add_scatter(x=series["step"], y=series["grad_norm"], name=f"{name} grad norm", row=1, col=2, mode="lines")
    fig.update_layout(title="Training curves")
    figures.append(("curves", fig))

    dpo = data["dpo"]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_scatter(x=dpo["step"], y=dpo["margin"], name="reward margin", mode="lines")
    fig.add_scatter(x=dpo["step"], y=dpo["accuracy"], name="preference accuracy", mode="lines", secondary_y=True)
    fig.update_layout(title="DPO: implicit reward margin and preference accuracy")
    figures.append(("dpo", fig))

    grpo = data.get("grpo")
    if grpo:
        fig = make_subplots(rows=1, cols=2, subplot_titles=("reward and pass@1 of the samples", "pass@1 by tier"))
        fig.add_scatter(x=grpo["step"], y=grpo["reward"], name="reward (mean)", mode="lines", row=1, col=1)
        fig.add_scatter(x=grpo["step"], y=grpo["pass@1"], name="pass@1", mode="lines", row=1, col=1)
        if grpo["eval_step"]:
            fig.add_scatter(x=grpo["eval_step"], y=grpo["eval_reward"], name="held-out reward (greedy)",
                            mode="lines+markers", row=1, col=1)
        for tier, values in grpo["tiers"].items():
            fig.add_scatter(x=grpo["step"], y=values, name=tier.replace("_", " "), mode="lines", row=1, col=2)
        fig.update_layout(title="GRPO: reward curve and pass rate by tier (training samples)")
        figures.append(("grpo", fig))

    groups = sorted(data["scores"]["base"]["groups"])
    labels = [*groups, "composite"]
    fig = go.Figure()
    for model in data["models"]:
        scores = data["scores"][model]
        rows = [scores["groups"][g] for g in groups] + [scores["composite"]]
        fig.add_bar(
            name=model, x=labels, y=[r["score"] for r in rows], marker_color=COLORS[model],
            error_y={"type": "data", "symmetric": False,
                     "array": [r["ci_high"] - r["score"] for r in rows],
                     "arrayminus": [r["score"] - r["ci_low"] for r in rows]},
        )
    fig.update_layout(barmode="group", title="Capability scores (0–100) with 95% bootstrap CIs", yaxis_range=[0, 100])
    figures.append(("scores", fig))
    return figures


_CHECK_SCRIPT = """
<script>
window.addEventListener('load', function () {
  setTimeout(function () {
    var charts = document.querySelectorAll('.js-plotly-plot');
    var withData = 0, points = 0;
    charts.forEach(function (div) {
      var traces = (div._fullData || []);
      var n = traces.reduce(function (acc, t) { return acc + ((t.y && t.y.length) || 0); }, 0);
      if (div.querySelector('.main-svg') && n > 0) { withData += 1; points += n; }
    });
    var verdict = {charts: charts.length, with_data: withData, points: points, errors: window.__reportErrors};
    document.getElementById('render-check').textContent = JSON.stringify(verdict);
  }, 500);
});
</script>
"""


def _table(data: dict[str, Any]) -> str:
    rows = []
    groups = sorted(data["scores"]["base"]["groups"])
    for label in [*groups, "composite"]:
        cells = []
        for model in data["models"]:
            s = data["scores"][model]["composite"] if label == "composite" else data["scores"][model]["groups"][label]
            cells.append(f"<td>{s['score']:.1f} <small>[{s['ci_low']:.1f}, {s['ci_high']:.1f}]</small></td>")
        rows.append(f"<tr><th>{html.escape(label)}</th>{''.join(cells)}</tr>")
    head = "<tr><th></th>" + "".join(f"<th>{m}</th>" for m in data["models"]) + "</tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def build_report(run_dir: Path, config: Any, timings: dict[str, float], models: tuple[str, ...] = MODELS
                 ) -> dict[str, Any]:
    import plotly.io as pio

    data = collect(run_dir, models)
    data["timings_s"] = timings
    summary = []
    for name, comparison in data["comparisons"].items():
        summary += [f"{name}: {line}" for line in comparison.get("summary", [])]
    data["summary"] = summary
    data["reading_the_verdicts"] = READING_THE_VERDICTS
    parts = []
    for index, (name, fig) in enumerate(_figures(data)):
        fig.update_layout(template="plotly_white", height=420, margin={"t": 60, "b": 40})
        parts.append(f'<section id="chart-{name}">' + pio.to_html(
            fig, full_html=False, include_plotlyjs=(index == 0), div_id=f"plot-{name}", config={"displaylogo": False}
        ) + "</section>")
    summary_html = "".join(f"<li>{html.escape(line)}</li>" for line in summary)
    timing_html = ", ".join(f"{k} {v:.0f}s" for k, v in timings.items())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>posttrain flywheel report</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse}}td,th{{padding:4px 12px;border-bottom:1px solid #ddd;text-align:left}}
small{{color:#777}}#render-check{{color:#999;font-size:10px}}</style>
<script>window.__reportErrors = []; window.addEventListener('error', function (e) {{ window.__reportErrors.push(String(e.message || e)); }});</script>
</head><body>
<h1>posttrain flywheel round</h1>
<p>Run directory <code>{html.escape(str(run_dir))}</code>. Stage times: {html.escape(timing_html)}.</p>
<h2>Score jump</h2>{_table(data)}
<ul>{summary_html}</ul>
<p id="reading-verdicts"><small>{html.escape(READING_THE_VERDICTS)}</small></p>
{''.join(parts)}
<pre id="render-check">pending</pre>
{_CHECK_SCRIPT}
</body></html>"""
    html_path, json_path = run_dir / "report.html", run_dir / "report.json"
    html_path.write_text(page, encoding="utf-8")
    json_path.write_text(json.dumps(data, indent=1))
    return {"html": str(html_path), "json": str(json_path), "summary": summary}
