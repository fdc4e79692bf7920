"""One self-contained HTML page (plotly.js inlined once, no network) and its ``report.json``.

A small script at the end of the page records JavaScript errors and checks that every chart drew data;
it writes its verdict into ``#render-check`` (hidden from readers) so a headless browser test can read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.report.tables import esc

_STYLE = """
body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:0.6em 0}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}
thead th{border-bottom:2px solid #bbb}table.comparisons td,table.scores td{white-space:nowrap}table.comparisons td:last-child{white-space:normal}
table.comparisons tr:has(> th:not(:empty)) > *{border-top:2px solid #bbb}small{color:#777}.mark{color:#c9a227}
.verdict.up{color:#1d7a3e;font-weight:600}.verdict.down{color:#b3261e;font-weight:600}.verdict.few{color:#8a6d00}
section.round{border-top:3px solid #3d7ddb;margin-top:2.5em}details{margin:0.5em 0;color:#444}
#render-check{display:none}
"""

_ERRORS_SCRIPT = ("<script>window.__reportErrors = []; window.addEventListener('error', function (e) "
                  "{ window.__reportErrors.push(String(e.message || e)); });</script>")

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
    var check = document.getElementById('render-check');
    var verdict = {charts: charts.length, with_data: withData, points: points, errors: window.__reportErrors,
                   check_hidden: window.getComputedStyle(check).display === 'none'};
    check.textContent = JSON.stringify(verdict);
  }, 500);
});
</script>
"""


@dataclass
class Section:
    """A titled part of the page: HTML first (tables, text), then its charts as ``(name, figure)``."""

    title: str
    body: str = ""
    figures: list[tuple[str, Any]] = field(default_factory=list)
    level: int = 2
    css: str = ""


@dataclass
class Page:
    title: str
    intro: str = ""
    sections: list[Section] = field(default_factory=list)

    def add(self, title: str, body: str = "", figures: list[tuple[str, Any]] | None = None, level: int = 2,
            css: str = "") -> None:
        if body or figures:
            self.sections.append(Section(title, body, list(figures or []), level, css))

    def html(self) -> str:
        import plotly.io as pio

        parts, first = [], True
        for section in self.sections:
            charts = []
            for name, fig in section.figures:
                fig.update_layout(template="plotly_white", height=400, margin={"t": 60, "b": 40})
                charts.append(f'<div id="chart-{esc(name)}">' + pio.to_html(
                    fig, full_html=False, include_plotlyjs=first, div_id=f"plot-{name}",
                    config={"displaylogo": False}) + "</div>")
                first = False
            level = section.level
            css = f' class="{section.css}"' if section.css else ""
            parts.append(f"<section{css}><h{level}>{esc(section.title)}</h{level}>{section.body}{''.join(charts)}"
                         "</section>")
        return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{esc(self.title)}</title>
<style>{_STYLE}</style>
{_ERRORS_SCRIPT}
</head><body>
<h1>{esc(self.title)}</h1>
{self.intro}
{''.join(parts)}
<pre id="render-check">pending</pre>
{_CHECK_SCRIPT}
</body></html>"""

    def chart_count(self) -> int:
        return sum(len(s.figures) for s in self.sections)


def write_page(page: Page, data: dict[str, Any], html_path: Path) -> dict[str, str]:
    """Write ``html_path`` and the numbers beside it (same name, ``.json``); return both paths."""
    html_path.parent.mkdir(parents=True, exist_ok=True)
    json_path = html_path.with_suffix(".json")
    html_path.write_text(page.html(), encoding="utf-8")
    json_path.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    return {"html": str(html_path), "json": str(json_path)}
