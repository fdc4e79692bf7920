"""The report's charts drawn from a run's metrics.jsonl: axes that show a constant series, no empty panels.

The series come from ``posttrain.report.collect.training_series`` over a metrics.jsonl written here in the
shape the GRPO loop writes it (a Python reward logs ``reward_mean`` but no verifier pass rates).
"""

from __future__ import annotations

import json

from posttrain.report.collect import training_series
from posttrain.report.figures import rl_figure, training_figures


def _grpo_run(tmp_path, tiers: bool) -> dict:
    rows = []
    for step in range(6):
        row = {"step": step, "loss": 0.1 - 0.01 * step, "grad_norm": 0.5 + 0.1 * step, "lr": 2e-4,
               "reward_mean": 0.2 + 0.05 * step}
        if tiers:
            row |= {"pass@1": 0.3, "pass@1/tier_1": 0.5, "pass@1/tier_2": 0.1}
        rows.append(row)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return training_series(tmp_path)


def _panels(fig) -> dict[str, str]:
    """Subplot title → the y-axis name of its panel (plotly's layout keys: yaxis, yaxis2, …)."""
    titles = [a.text for a in fig.layout.annotations]
    return {title: "yaxis" if i == 0 else f"yaxis{i + 1}" for i, title in enumerate(titles)}


def test_a_constant_learning_rate_gets_an_axis_around_its_value(tmp_path):
    series = _grpo_run(tmp_path, tiers=True)
    (_, curves), *_ = training_figures(series, "GRPO", "grpo")
    lr_axis = curves.layout[_panels(curves)["learning rate"]]
    # Left to autorange, plotly draws a flat series v on [v - 1, v + 1]: 2e-4 looks like 0 on [-1, 1].
    assert lr_axis.range is not None
    low, high = lr_axis.range
    assert low < 2e-4 < high and high - low < 1e-3  # the value's own scale, not [-1, 1]
    # A series that moves keeps plotly's own range.
    assert curves.layout[_panels(curves)["loss"]].range is None


def test_a_constant_zero_series_gets_a_unit_axis(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / (s + 1), "lr": 0.0})
                                                    + "\n" for s in range(3)))
    (_, curves), *_ = training_figures(training_series(tmp_path), "SFT", "sft")
    low, high = curves.layout[_panels(curves)["learning rate"]].range
    assert low < 0 < high


def test_python_reward_without_tiers_has_no_empty_tier_panel(tmp_path):
    fig = rl_figure(_grpo_run(tmp_path, tiers=False), "GRPO")
    assert "pass@1 by tier" not in _panels(fig) and "by tier" not in fig.layout.title.text
    assert [trace.name for trace in fig.data] == ["reward (mean)"]
    with_tiers = rl_figure(_grpo_run(tmp_path, tiers=True), "GRPO")
    assert "pass@1 by tier" in _panels(with_tiers)
    assert {t.name for t in with_tiers.data} >= {"tier 1", "tier 2"}
