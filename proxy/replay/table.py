"""The terminal table of a replay: one row per session, and the totals."""
from __future__ import annotations

from rich.table import Table

from .results import SessionResult

COLUMNS = ("session", "turns", "limit", "tokens sent", "tokens forwarded", "saved", "levels fired @ turns",
           "points / 100 turns", "summaries", "summaries / point", "summaries wasted", "prefix-stable",
           "cache read", "cache written",
           "cost without", "cost with", "refused", "over limit", "reactive",
           "task/files/error/last 6")


def money(value: float | None) -> str:
    return "n/a" if value is None else f"${value:,.4f}"


def wasted_text(summaries: int, tokens: int) -> str:
    """Summaries paid for whose note was never sent, and their tokens: `0`, or `1 (2,345 tokens)`."""
    return f"{summaries} ({tokens:,} tokens)" if summaries else "0"


def levels_text(result: SessionResult) -> str:
    """`snip@12,30 autocompact@31`: each level that ran and the turns it ran at."""
    return " ".join(f"{level}@{','.join(map(str, turns))}" for level, turns in result.levels_fired.items()) or "-"


def saved(sent: int, forwarded: int) -> str:
    """The share of the agent's tokens not forwarded, over the turns that were forwarded."""
    return f"{1 - forwarded / sent:.0%}" if sent else "-"


def stable_text(results: list[SessionResult]) -> str:
    return f"{sum(r.stable_turns for r in results)}/{sum(max(0, len(r.turns) - 1) for r in results)}"


def total_cost(results: list[SessionResult], key: str) -> tuple[float | None, int]:
    """The sum over the sessions with prices, and how many had none."""
    values = [getattr(r, key) for r in results]
    priced = [v for v in values if v is not None]
    return (sum(priced) if priced else None), len(values) - len(priced)


def results_table(results: list[SessionResult]) -> Table:
    table = Table(title="ctxgate replay")
    for name in COLUMNS:
        left = name in ("session", "levels fired @ turns")
        table.add_column(name, justify="left" if left else "right", overflow="fold")
    for r in results:
        table.add_row(r.name, str(len(r.turns)), str(r.limit), str(r.sent_total), str(r.forwarded_total),
                      saved(r.sent_answered, r.forwarded_total), levels_text(r), f"{r.points_per_100_turns:.1f}",
                      str(r.summaries), f"{r.summaries_per_point:.2f}",
                      wasted_text(r.summaries_wasted, r.wasted_summary_tokens), stable_text([r]),
                      str(r.cache_read_tokens), str(r.cache_write_tokens), money(r.cost_without),
                      money(r.cost_with), str(r.refused_turns), str(len(r.over_limit_turns)), str(r.reactive),
                      r.probes_text)
    unpriced = total_cost(results, "cost_with")[1]
    if len(results) > 1:
        points = sum(len(r.compactions) for r in results)
        turns, summaries = sum(len(r.turns) for r in results), sum(r.summaries for r in results)
        table.add_section()
        mark = "*" if unpriced else ""
        table.add_row("total", str(sum(len(r.turns) for r in results)), "", str(sum(r.sent_total for r in results)),
                      str(sum(r.forwarded_total for r in results)),
                      saved(sum(r.sent_answered for r in results), sum(r.forwarded_total for r in results)), "",
                      f"{100 * points / max(1, turns):.1f}", str(summaries), f"{summaries / max(1, points):.2f}",
                      wasted_text(sum(r.summaries_wasted for r in results),
                                  sum(r.wasted_summary_tokens for r in results)),
                      stable_text(results), str(sum(r.cache_read_tokens for r in results)),
                      str(sum(r.cache_write_tokens for r in results)),
                      money(total_cost(results, "cost_without")[0]) + mark,
                      money(total_cost(results, "cost_with")[0]) + mark, str(sum(r.refused_turns for r in results)),
                      str(sum(len(r.over_limit_turns) for r in results)), str(sum(r.reactive for r in results)),
                      "")
    if unpriced:
        table.caption = (f"{'* ' if len(results) > 1 else ''}{unpriced} session(s) whose model has no price in "
                         "litellm's cost map: costs n/a" + (", left out of the totals" if len(results) > 1 else ""))
    return table
