"""The terminal table of a replay: one row per session, and the totals."""
from __future__ import annotations

from rich.table import Table

from .results import SessionResult


def money(value: float | None) -> str:
    return "n/a" if value is None else f"${value:,.4f}"


def levels_text(result: SessionResult) -> str:
    """`snip@12,30 autocompact@31`: each level that ran and the turns it ran at."""
    return " ".join(f"{level}@{','.join(map(str, turns))}" for level, turns in result.levels_fired.items()) or "-"


def _saved(sent: int, forwarded: int) -> str:
    return f"{1 - forwarded / sent:.0%}" if sent else "-"


def _total_cost(results: list[SessionResult], key: str) -> float | None:
    values = [getattr(r, key) for r in results]
    return None if any(v is None for v in values) else sum(values)


def results_table(results: list[SessionResult]) -> Table:
    table = Table(title="ctxgate replay", show_lines=False)
    for name, justify in (("session", "left"), ("turns", "right"), ("limit", "right"), ("tokens sent", "right"),
                          ("tokens forwarded", "right"), ("saved", "right"), ("levels fired @ turns", "left"),
                          ("summaries", "right"), ("prefix-stable", "right"), ("cost without", "right"),
                          ("cost with", "right"), ("refused", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in results:
        table.add_row(r.name, str(len(r.turns)), str(r.limit), str(r.sent_total), str(r.forwarded_total),
                      _saved(r.sent_total, r.forwarded_total), levels_text(r), str(r.summaries),
                      f"{r.stable_turns}/{max(0, len(r.turns) - 1)}", money(r.cost_without), money(r.cost_with),
                      str(r.refused_turns))
    if len(results) > 1:
        sent, forwarded = sum(r.sent_total for r in results), sum(r.forwarded_total for r in results)
        table.add_section()
        table.add_row("total", str(sum(len(r.turns) for r in results)), "", str(sent), str(forwarded),
                      _saved(sent, forwarded), "", str(sum(r.summaries for r in results)),
                      f"{sum(r.stable_turns for r in results)}/{sum(max(0, len(r.turns) - 1) for r in results)}",
                      money(_total_cost(results, "cost_without")), money(_total_cost(results, "cost_with")),
                      str(sum(r.refused_turns for r in results)))
    return table
