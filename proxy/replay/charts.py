"""The tokens-per-turn chart of one session: as plotly traces for the HTML report, and as a
PNG (matplotlib, Agg: no display needed) beside it.

Both draw the same series: the agent's whole history each turn, what ctxgate forwarded,
the limit and the trigger, a marker per compaction level where it ran, a cross where a
turn was refused, and the turns whose forwarded prefix was stable shaded.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .results import SessionResult

LEVEL_COLOURS = {"snip": "#e45756", "microcompact": "#f58518", "collapse": "#54a24b", "autocompact": "#b279a2"}
LEVEL_SIZES = {"snip": 18, "microcompact": 14, "collapse": 10, "autocompact": 7}
"""Several levels often run at one turn: their markers are nested diamonds, the cheapest outermost."""
SENT, FORWARDED, REFUSED = "agent history", "forwarded", "refused"


def stable_spans(result: SessionResult) -> list[tuple[int, int]]:
    """Runs of consecutive prefix-stable turns, as (first turn, last turn)."""
    spans: list[tuple[int, int]] = []
    for row in result.turns:
        if not row.stable:
            continue
        if spans and spans[-1][1] == row.turn - 1:
            spans[-1] = (spans[-1][0], row.turn)
        else:
            spans.append((row.turn, row.turn))
    return spans


def levels_outermost_first(result: SessionResult) -> list[tuple[str, list[int]]]:
    """The levels that ran, the largest marker first, so each smaller one is drawn over it."""
    return sorted(result.levels_fired.items(), key=lambda item: -LEVEL_SIZES.get(item[0], 12))


def file_name(result: SessionResult) -> str:
    return re.sub(r"[^\w.-]+", "_", result.name).strip("_") or "session"


def plotly_figure(result: SessionResult) -> Any:
    import plotly.graph_objects as go

    turns = [row.turn for row in result.turns]
    forwarded = {row.turn: row.forwarded for row in result.turns}
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=turns, y=[row.sent for row in result.turns], name=SENT, mode="lines+markers",
                             line={"color": "#9e9e9e"}, marker={"size": 4}))
    fig.add_trace(go.Scatter(x=turns, y=[row.forwarded for row in result.turns], name=FORWARDED,
                             mode="lines+markers", line={"color": "#4c78a8"}, marker={"size": 4}))
    for level, at in levels_outermost_first(result):
        fig.add_trace(go.Scatter(x=at, y=[forwarded[t] for t in at], name=f"compaction: {level}", mode="markers",
                                 marker={"size": LEVEL_SIZES.get(level, 12), "symbol": "diamond",
                                         "color": LEVEL_COLOURS.get(level),
                                         "line": {"width": 1, "color": "#333"}}))
    refused = [row for row in result.turns if row.refused]
    if refused:
        fig.add_trace(go.Scatter(x=[r.turn for r in refused], y=[r.sent for r in refused], name=REFUSED,
                                 mode="markers", marker={"size": 12, "symbol": "x", "color": "#d62728"}))
    for first, last in stable_spans(result):
        fig.add_vrect(x0=first - 0.5, x1=last + 0.5, fillcolor="#72b7b2", opacity=0.12, line_width=0, layer="below")
    fig.add_hline(y=result.limit, line={"color": "#d62728", "dash": "dash"},
                  annotation_text=f"limit {result.limit}", annotation_position="top left")
    fig.add_hline(y=result.trigger, line={"color": "#f58518", "dash": "dot"},
                  annotation_text=f"trigger {result.trigger}", annotation_position="bottom left")
    fig.update_layout(height=380, margin={"l": 60, "r": 20, "t": 30, "b": 40}, xaxis_title="agent turn",
                      yaxis_title="tokens", legend={"orientation": "h", "y": -0.2}, template="plotly_white")
    return fig


def write_png(result: SessionResult, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    turns = [row.turn for row in result.turns]
    forwarded = {row.turn: float("nan") if row.forwarded is None else row.forwarded for row in result.turns}
    for first, last in stable_spans(result):
        ax.axvspan(first - 0.5, last + 0.5, color="#72b7b2", alpha=0.15, linewidth=0)
    ax.plot(turns, [row.sent for row in result.turns], color="#9e9e9e", marker=".", label=SENT)
    ax.plot(turns, [forwarded[t] for t in turns], color="#4c78a8", marker=".", label=FORWARDED)
    for level, at in levels_outermost_first(result):
        ax.scatter(at, [forwarded[t] for t in at], s=LEVEL_SIZES.get(level, 12) ** 2 / 2, marker="D",
                   color=LEVEL_COLOURS.get(level), edgecolors="#333", zorder=3, label=f"compaction: {level}")
    refused = [row for row in result.turns if row.refused]
    if refused:
        ax.scatter([r.turn for r in refused], [r.sent for r in refused], s=70, marker="x", color="#d62728",
                   label=REFUSED)
    ax.axhline(result.limit, color="#d62728", linestyle="--", linewidth=1, label=f"limit {result.limit}")
    ax.axhline(result.trigger, color="#f58518", linestyle=":", linewidth=1, label=f"trigger {result.trigger}")
    ax.set_title(result.name, fontsize=10)
    ax.set_xlabel("agent turn")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
