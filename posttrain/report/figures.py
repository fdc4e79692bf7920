"""The report's charts, one plotly figure per function, from the numbers of ``posttrain.report.collect``.

Each training run gets its own figures (its own step axis): SFT and DPO steps count different things,
so their curves never share an x-axis. Accuracies and pass rates are drawn on [0, 1].
"""

from __future__ import annotations

from typing import Any

COLORS = {"base": "#9aa5b1", "sft": "#3d7ddb", "dpo": "#e0662b", "grpo": "#2a9d5c"}
PALETTE = ("#3d7ddb", "#e0662b", "#2a9d5c", "#8e5bd6", "#c9a227", "#9aa5b1")
UNIT_RANGE = [0, 1.02]  # accuracies and pass rates: the whole [0, 1], a sliver above 1 so a line at 1 shows


def flat_range(values: list[Any]) -> list[float] | None:
    """An axis range for a series that never moves (a constant learning rate), else None (plotly's own).

    Left to itself plotly draws a flat series ``v`` on ``[v - 1, v + 1]``, so a learning rate of 2e-4 reads
    as a line at 0 on [-1, 1]; the value belongs in the middle of an axis of its own scale.
    """
    finite = {v for v in values if isinstance(v, int | float) and v == v and abs(v) != float("inf")}
    if len(finite) != 1:
        return None
    (value,) = finite
    half = abs(value) / 2 or 1.0
    return [value - half, value + half]


def funnel_figure(funnel: dict[str, Any], title: str = "Curation funnel"):
    """Kept and dropped records per stage, in the funnel's own stage order (any stage it lists shows)."""
    import plotly.graph_objects as go

    stages = funnel["stages"]
    names = [s["stage"] for s in stages]
    fig = go.Figure()
    fig.add_bar(name="kept", x=names, y=[s["kept"] for s in stages], marker_color="#3d7ddb")
    fig.add_bar(name="dropped", x=names, y=[sum(s["dropped"].values()) for s in stages], marker_color="#e0662b",
                hovertext=[", ".join(f"{k}={v}" for k, v in s["dropped"].items()) or "none" for s in stages])
    fig.update_layout(barmode="stack", title=f"{title}: {funnel['input']} in → {funnel['kept']} kept")
    return fig


def curves_figure(series: dict[str, Any], label: str):
    """Loss (with the held-out loss when logged), gradient norm and learning rate of one run, on its steps."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = [("loss", "loss"), ("grad_norm", "gradient norm"), ("lr", "learning rate")]
    panels = [(key, title) for key, title in panels if series.get(key)]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[title for _, title in panels])
    for col, (key, title) in enumerate(panels, start=1):
        fig.add_trace(go.Scatter(x=series["step"], y=series[key], name=title, mode="lines",
                                 showlegend=False), row=1, col=col)
        fig.update_xaxes(title_text=f"{label} step", row=1, col=col)
        if key != "loss" and (flat := flat_range(series[key])):  # loss shares its panel with the held-out loss
            fig.update_yaxes(range=flat, row=1, col=col)
    held_out = series.get("eval") or {}
    if held_out.get("loss"):
        fig.add_trace(go.Scatter(x=held_out["step"], y=held_out["loss"], name="held-out loss",
                                 mode="lines+markers"), row=1, col=1)
    fig.update_layout(title=f"{label}: training curves")
    return fig


def tiers_figure(series: dict[str, Any], label: str):
    """Examples drawn per tier at each step (the curriculum's mix)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for key, counts in series["tiers"].items():
        fig.add_scatter(x=series["step"], y=counts, name=key.replace("_", " "), stackgroup="tiers", mode="lines")
    fig.update_layout(title=f"{label}: tier mix per step (examples drawn)", xaxis_title=f"{label} step",
                      yaxis_title="examples")
    return fig


def preference_figure(series: dict[str, Any], label: str):
    """Reward margin (left axis) and preference accuracy (right axis, [0, 1]), with the held-out accuracy."""
    from plotly.subplots import make_subplots

    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_scatter(x=series["step"], y=series["margin"], name="reward margin", mode="lines")
    if series.get("accuracy"):
        fig.add_scatter(x=series["step"], y=series["accuracy"], name="preference accuracy", mode="lines",
                        secondary_y=True)
    held_out = series.get("eval") or {}
    accuracy = held_out.get("rewards/accuracy") or held_out.get("accuracy")
    if accuracy:
        fig.add_scatter(x=held_out["step"], y=accuracy, name="held-out accuracy", mode="lines+markers",
                        secondary_y=True)
    fig.update_xaxes(title_text=f"{label} step")
    fig.update_yaxes(title_text="margin", secondary_y=False)
    fig.update_yaxes(title_text="accuracy", range=UNIT_RANGE, secondary_y=True)
    fig.update_layout(title=f"{label}: implicit reward margin and preference accuracy")
    return fig


def rl_figure(series: dict[str, Any], label: str):
    """GRPO: mean reward and pass@1 of the training samples (with the held-out reward), and pass@1 by tier
    when the reward logged it (a verifier reward on tiered prompts; a Python reward has no tier panel)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    by_tier = series.get("pass_by_tier") or {}
    titles = ("reward and pass@1 of the samples", "pass@1 by tier")[:2 if by_tier else 1]
    fig = make_subplots(rows=1, cols=len(titles), subplot_titles=titles)
    fig.add_trace(go.Scatter(x=series["step"], y=series["reward"], name="reward (mean)", mode="lines"), row=1, col=1)
    if series.get("pass@1"):
        fig.add_trace(go.Scatter(x=series["step"], y=series["pass@1"], name="pass@1", mode="lines"), row=1, col=1)
    held_out = series.get("eval") or {}
    if held_out.get("reward"):
        fig.add_trace(go.Scatter(x=held_out["step"], y=held_out["reward"], name="held-out reward (greedy)",
                                 mode="lines+markers"), row=1, col=1)
    for tier, values in by_tier.items():
        fig.add_trace(go.Scatter(x=series["step"], y=values, name=tier.replace("_", " "), mode="lines"), row=1, col=2)
    fig.update_xaxes(title_text=f"{label} step")
    if by_tier:
        fig.update_yaxes(range=UNIT_RANGE, row=1, col=2)
    what = "reward curve and pass rate by tier" if by_tier else "reward curve"
    fig.update_layout(title=f"{label}: {what} (training samples)")
    return fig


def episodes_figure(series: dict[str, Any], label: str):
    """Multi-turn GRPO (``env:``): per step, the share of sampled episodes that called the tool, the mean model turns
    per episode, and the shares of tool calls that failed and of episodes that failed (reward 0); the held-out
    greedy episodes' tool-call rate where ``data.eval`` logged it. Reward by tier is ``rl_figure``'s panel."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    episodes = series["episodes"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tool use (shares)", "model turns per episode"))
    for key, name in (("tool_call_rate", "tool-call rate"), ("tool_error_share", "tool errors / calls"),
                      ("failed_share", "failed episodes")):
        if any(v is not None for v in episodes[key]):
            fig.add_trace(go.Scatter(x=series["step"], y=episodes[key], name=name, mode="lines"), row=1, col=1)
    held_out = series.get("eval") or {}
    if held_out.get("tool_call_rate"):
        fig.add_trace(go.Scatter(x=held_out["step"], y=held_out["tool_call_rate"], name="held-out tool-call rate",
                                 mode="lines+markers"), row=1, col=1)
    fig.add_trace(go.Scatter(x=series["step"], y=episodes["turns_mean"], name="turns (mean)", mode="lines"),
                  row=1, col=2)
    fig.update_yaxes(range=UNIT_RANGE, row=1, col=1)
    fig.update_xaxes(title_text=f"{label} step")
    fig.update_layout(title=f"{label}: episodes (tool calls, turns, failures)")
    return fig


def expert_load_figure(series: dict[str, Any], label: str):
    """A mixture of experts' balance as a heat map, MoE layer × step: the busiest expert's tokens over the mean
    (1 is perfect balance; K·E/K = E would be every token on one expert), with the entropy on hover."""
    import plotly.graph_objects as go

    moe = series["moe"]
    names = [f"layer {layer}" for layer in moe["layers"]]
    entropy = [[f"{e:.3f}" if isinstance(e, int | float) else "n/a" for e in row] for row in moe["entropy"]]
    fig = go.Figure(go.Heatmap(z=moe["max_over_mean"], x=series["step"], y=names, customdata=entropy,
                               colorscale="YlOrRd", zmin=1.0, colorbar={"title": "max / mean"},
                               hovertemplate="%{y}, step %{x}<br>max/mean %{z:.2f}<br>entropy %{customdata}"
                                             "<extra></extra>"))
    fig.update_layout(title=f"{label}: expert load per MoE layer (busiest expert's tokens / mean)",
                      xaxis_title=f"{label} step", yaxis={"autorange": "reversed"})
    return fig


def training_figures(series: dict[str, Any] | None, label: str, prefix: str) -> list[tuple[str, Any]]:
    """The figures a run's logged series support, each named ``<prefix>-<chart>`` (unique on the page)."""
    if not series or not series.get("step"):
        return []
    figures = [(f"{prefix}-curves", curves_figure(series, label))]
    if series.get("tiers"):
        figures.append((f"{prefix}-tiers", tiers_figure(series, label)))
    if series.get("margin"):
        figures.append((f"{prefix}-preference", preference_figure(series, label)))
    if series.get("reward"):
        figures.append((f"{prefix}-rl", rl_figure(series, label)))
    if series.get("episodes"):
        figures.append((f"{prefix}-episodes", episodes_figure(series, label)))
    if series.get("moe"):
        figures.append((f"{prefix}-expert-load", expert_load_figure(series, label)))
    return figures


def scores_figure(scores: dict[str, dict[str, Any]], kind: str = "groups", title: str | None = None):
    """Each model's score (0–100) per group (or tier), and the composite, with its 95% bootstrap CI."""
    import plotly.graph_objects as go

    labels = sorted({name for s in scores.values() for name in s.get(kind, {})})
    columns = [*labels, "composite"] if kind == "groups" else labels
    fig = go.Figure()
    for index, (model, s) in enumerate(scores.items()):
        rows = [s[kind].get(c) if c != "composite" else s["composite"] for c in columns]
        rows = [r or {"score": None, "ci_low": None, "ci_high": None} for r in rows]
        fig.add_bar(
            name=model, x=[f"{kind[:-1]} {c}" if kind == "tiers" else c for c in columns],
            y=[r["score"] for r in rows], marker_color=COLORS.get(model, PALETTE[index % len(PALETTE)]),
            error_y={"type": "data", "symmetric": False,
                     "array": [None if r["score"] is None else r["ci_high"] - r["score"] for r in rows],
                     "arrayminus": [None if r["score"] is None else r["score"] - r["ci_low"] for r in rows]},
        )
    default = f"Scores by {kind[:-1]} (0–100) with 95% bootstrap CIs"
    fig.update_layout(barmode="group", title=title or default, yaxis_range=[0, 100])
    return fig
