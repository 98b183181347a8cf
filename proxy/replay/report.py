"""The replay report: one self-contained HTML file (plotly's JavaScript inlined once, no
network when it is viewed), a PNG per session and the figures as JSON.

Every chart is a `<div class="replay-chart" id="chart-K">` (K: the session's position), so a
browser can read its traces back: `document.getElementById("chart-0").data`.
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .charts import file_name, plotly_figure, stable_spans, write_png
from .results import CompactionPoint, SessionResult
from .table import levels_text, money, saved, stable_text, total_cost, wasted_text

HTML_COLUMNS = ("session", "turns", "limit", "tokens sent", "tokens forwarded", "saved", "levels fired @ turns",
                "summaries", "summaries wasted", "prefix-stable", "cost without", "cost with", "refused",
                "over limit")
"""The terminal table's columns the page's table has, a cell each (`_totals`)."""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1300px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: right; }
th:first-child, td:first-child, th:nth-child(7), td:nth-child(7) { text-align: left; }
tr.total td { font-weight: 600; background: #f3f6fa; }
section.session { border-top: 2px solid #4c78a8; margin-top: 28px; padding-top: 8px; }
pre { background: #f6f8fa; padding: 8px; white-space: pre-wrap; font-size: 12px; max-height: 320px; overflow: auto; }
details { margin: 6px 0; } summary { cursor: pointer; font-weight: 600; }
.note { color: #555; font-size: 13px; }
"""


@dataclass(frozen=True)
class Written:
    html: Path
    pngs: list[Path]
    data: Path

    def __str__(self) -> str:
        return f"{self.html} ({len(self.pngs)} PNG charts, figures in {self.data.name})"


def _cell(value: Any) -> str:
    return f"<td>{html.escape(str(value))}</td>"


def _row(cells: list[str]) -> str:
    return "<tr>" + "".join(cells) + "</tr>"


def _totals(results: list[SessionResult]) -> str:
    """The terminal table's columns, a row per session, and the totals."""
    rows = []
    unpriced = 0
    for k, r in enumerate(results):
        rows.append(_row([f'<td><a href="#session-{k}">{html.escape(r.name)}</a></td>'] + [_cell(v) for v in (
            len(r.turns), r.limit, r.sent_total, r.forwarded_total, saved(r.sent_answered, r.forwarded_total),
            levels_text(r), r.summaries, wasted_text(r.summaries_wasted, r.wasted_summary_tokens), stable_text([r]),
            money(r.cost_without), money(r.cost_with), r.refused_turns, len(r.over_limit_turns))]))
    if len(results) > 1:
        without, unpriced = total_cost(results, "cost_without")
        mark = "*" if unpriced else ""
        forwarded = sum(r.forwarded_total for r in results)
        rows.append('<tr class="total">' + "".join(_cell(v) for v in (
            "total", sum(len(r.turns) for r in results), "", sum(r.sent_total for r in results), forwarded,
            saved(sum(r.sent_answered for r in results), forwarded), "", sum(r.summaries for r in results),
            wasted_text(sum(r.summaries_wasted for r in results), sum(r.wasted_summary_tokens for r in results)),
            stable_text(results), money(without) + mark, money(total_cost(results, "cost_with")[0]) + mark,
            sum(r.refused_turns for r in results), sum(len(r.over_limit_turns) for r in results))) + "</tr>")
    note = (f'<p class="note">* Left out of the cost totals: {unpriced} session(s) whose model has no price in '
            "litellm's cost map.</p>") if len(results) > 1 and unpriced else ""
    return '<table id="totals">' + _row([f"<th>{h}</th>" for h in HTML_COLUMNS]) + "".join(rows) + "</table>" + note


def _point(p: CompactionPoint) -> str:
    parts = [f"<details><summary>turn {p.turn}: {html.escape(', '.join(p.levels) or 'no level')}"
             f"{' (prepared in the background)' if p.speculative else ''}: {p.tokens_before} → {p.tokens_after} "
             f"tokens; the first {p.messages_replaced} messages are now {p.messages_kept}</summary>"]
    for step in p.steps:
        span = step.get("span")
        parts.append(f'<div class="note">{html.escape(str(step.get("level")))}'
                     f"{f' on messages {span[0]}–{span[1]}' if span else ''}: {step.get('tokens_before')} → "
                     f"{step.get('tokens_after')} tokens</div>")
    if p.summary:
        parts.append("<div>Autocompact summary (kept):</div><pre>" + html.escape(p.summary) + "</pre>")
    if p.restored_files:
        parts.append("<div>Files restored: " + html.escape(", ".join(p.restored_files)) + "</div>")
    if p.restored:
        parts.append("<div>Working state restored:</div><pre>" + html.escape("\n\n".join(p.restored)) + "</pre>")
    for title, notes in (("Snip note (removed)", p.snip_notes), ("Collapse note (folded)", p.collapse_notes)):
        if notes:
            parts.append(f"<div>{title}:</div><pre>" + html.escape("\n\n".join(notes)) + "</pre>")
    return "".join(parts) + "</details>"


def _stable_text(r: SessionResult) -> str:
    spans = stable_spans(r)
    if not spans:
        return "No forwarded request started with the previous one."
    first, last = max(spans, key=lambda s: s[1] - s[0])
    return (f"Prefix-stable on {r.stable_turns} of {max(0, len(r.turns) - 1)} turns (shaded): the provider's "
            f"cache could serve the previous request each time. Longest stable run: turns {first}–{last}.")


def _session(k: int, r: SessionResult, chart: str) -> str:
    refused = [t for t in r.turns if t.refused]
    return (f'<section class="session" id="session-{k}"><h2>{html.escape(r.name)}</h2>'
            f'<p class="note">{html.escape(r.file)} · {html.escape(r.format)} · {html.escape(r.dialect)} · model '
            f"{html.escape(r.model)} · limit {r.limit} (effective budget {r.effective_budget}, trigger {r.trigger}) · "
            f"largest agent request {r.peak} tokens · summaries: {html.escape(r.summarizer)}</p>"
            f"{chart}<p class=\"note\">{html.escape(_stable_text(r))}</p>"
            + (f"<p class=\"note\">Refused (context_exhausted) at turns {', '.join(str(t.turn) for t in refused)}: "
               f"{html.escape(refused[0].refused[:300])}</p>" if refused else "")
            + (f"<p class=\"note\">Forwarded over the limit at turns {', '.join(map(str, r.over_limit_turns))}: "
               "no level could bring these under it; a provider would refuse them, and the gateway would then "
               "compact once more on the provider's error (not replayed).</p>" if r.over_limit_turns else "")
            + f"<h3>Compactions ({len(r.compactions)})</h3>"
            + ("".join(_point(p) for p in r.compactions) or "<p>None: every request fit.</p>") + "</section>")


def write_report(results: list[SessionResult], out: Path) -> Written:
    out.mkdir(parents=True, exist_ok=True)
    sections, pngs = [], []
    for k, r in enumerate(results):
        fig = plotly_figure(r)
        chart = fig.to_html(full_html=False, include_plotlyjs=k == 0, div_id=f"chart-{k}",
                            config={"displaylogo": False, "responsive": True})
        sections.append(_session(k, r, f'<div class="replay-chart" data-session="{k}">{chart}</div>'))
        stem = file_name(r)
        png = out / f"{stem}.png"
        if png in pngs:  # two names that only differ in characters a file name cannot hold
            png = out / f"{stem}-{k}.png"
        write_png(r, png)
        pngs.append(png)
    data = [r.to_dict() for r in results]
    summarizers = sorted({r.summarizer for r in results})
    page = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>ctxgate replay</title>"
            f"<style>{STYLE}</style></head><body><h1>ctxgate replay</h1>"
            f'<p class="note">{len(results)} sessions replayed through ctxgate\'s pipeline, in process, with no '
            "upstream. Tokens sent: what the agent's request held each turn; forwarded: what ctxgate would have "
            "sent instead. Costs are input tokens at list prices with the provider's prompt cache; with ctxgate "
            f"they include the summaries. Summaries by: {html.escape('; '.join(summarizers))}.</p>"
            + _totals(results) + "".join(sections)
            + '<script type="application/json" id="replay-data">'
            + json.dumps(data).replace("</", "<\\/") + "</script></body></html>")
    page_path = out / "report.html"
    page_path.write_text(page, encoding="utf-8")
    data_path = out / "report.json"
    data_path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    return Written(page_path, pngs, data_path)
