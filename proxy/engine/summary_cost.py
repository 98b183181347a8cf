"""What a compaction point's summaries cost, and which of them were paid for nothing.

A summary is paid for when the summariser answers. It is of use only once its note reaches
the upstream: a summary whose note no record keeps (a foreground point that kept another
result), or a background one dropped because its span is gone from the history, is waste.
Both are counted (`Waste`: the metrics' `ctxgate_summaries_wasted`, the replay's figure) so
the bet speculation makes, and any point that pays twice, can be seen.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import orjson

from ctxgate.pipeline.notes import is_summary_note
from .summary_reuse import ReusedSummary
from .turn_budget import Turn

Waste = Callable[[str, int, int], None]
"""Told (why, summaries, their tokens) when summaries paid for end in no note sent. Why:
`stale` (a background summary whose span the history no longer has), `superseded` (a background
summary finished after the session compacted otherwise), `unused` (a point's summary its
record does not keep); in a replay, `unneeded` (a background summary still pending when the
recording ends: the session never reached the trigger)."""


@dataclass
class SummaryCost:
    """The summaries one compaction point asked for: how many answered, and their tokens (the
    prompt and the reply, in the turn's count)."""
    calls: int = 0
    tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "tokens": self.tokens}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SummaryCost":
        return cls(**data) if data else cls()


def costed(turn: Turn, cost: SummaryCost) -> Turn:
    """`turn` whose summaries are added to `cost` as they answer, but for one an earlier
    attempt paid for (`summary_reuse.ReusedSummary`)."""
    ask = turn.summarize

    async def summarize(prompt: list[dict[str, Any]]) -> str:
        text = await ask(prompt)
        if not isinstance(text, ReusedSummary):
            cost.calls += 1
            cost.tokens += turn.counter.count_messages(prompt) + turn.counter.count(text)
        return text

    return replace(turn, summarize=summarize)


def summary_kept(view: list[dict[str, Any]], messages: list[dict[str, Any]]) -> bool:
    """Whether `messages` (a point's result) holds a summary note that `view` (its input) did not."""
    before = {orjson.dumps(m) for m in view if is_summary_note(m)}
    return any(is_summary_note(m) and orjson.dumps(m) not in before for m in messages)
