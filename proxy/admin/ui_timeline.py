"""A session's history as the dashboard draws it, read from its WAL (docs/wal.md).

One point per answered turn (a RESPONSE event): what the client sent, what was forwarded,
the budget then, and the compaction levels that fired before it (the COMPRESSION events since
the answered turn before; a turn that failed passes its levels on to the next answered one).
The budget is what ctxgate fits a request under (the limit less its safety margin), read from
the checkpoints: a checkpoint's `messages_tokens` plus `tokens_left`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ctxgate.pipeline.policy import CACHE_MIN_TOKENS
from ctxgate.wal.backend import WalLog
from ctxgate.wal.events import EventType

SUMMARY_LEVELS = ("autocompact", "speculative")
"""The levels that call the summary model: Autocompact, and the speculative Autocompact."""
CACHED_LOGS = 512


@dataclass
class Timeline:
    points: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    """Without their state; `turns` is the session's turn count when each was written."""
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    summary_calls: int = 0

    @property
    def cache_stable_share(self) -> float | None:
        """Of the answered turns, the share forwarded with no compaction before them: their
        prefix was the one the turn before sent, so a provider's prompt cache could hold."""
        if not self.points:
            return None
        return sum(1 for p in self.points if not p["levels"]) / len(self.points)

    @property
    def compaction_points(self) -> int:
        """Answered turns with a compaction before them: each rewrote what the provider cached."""
        return sum(1 for p in self.points if p["levels"])

    def cache_tokens(self) -> list[tuple[str | None, int, int]]:
        """Per answered turn: its model, the tokens a provider read from its cache (the turn
        before's whole request, on a turn with no compaction before it, when at least
        `CACHE_MIN_TOKENS`) and the tokens it read afresh and wrote. At a compaction point
        nothing is counted as cached, though the prefix up to the earlier notes may still be."""
        out: list[tuple[str | None, int, int]] = []
        previous: int | None = None
        for p in self.points:
            tokens = p.get("prompt_tokens") or p.get("tokens_out") or 0
            cached = previous if previous is not None and not p["levels"] and previous >= CACHE_MIN_TOKENS else 0
            cached = min(cached, tokens)
            out.append((p.get("model"), cached, tokens - cached))
            previous = tokens
        return out


def build(events: list[dict[str, Any]]) -> Timeline:
    """`events` in seq order, a session's archives and live log together."""
    timeline = Timeline()
    levels: list[str] = []
    budget: int | None = None
    for event in events:
        kind = event["type"]
        if kind == EventType.COMPRESSION.value:
            level = str(event.get("level"))
            timeline.summary_calls += level in SUMMARY_LEVELS
            if level not in levels:
                levels.append(level)
        elif kind == EventType.CHECKPOINT.value:
            used, left = event.get("messages_tokens"), event.get("tokens_left")
            if isinstance(used, int) and isinstance(left, int):
                budget = used + left
            state = event["state"] if isinstance(event.get("state"), dict) else {}
            timeline.checkpoints.append({"seq": event["seq"], "reason": event.get("reason"),
                                         "level": event.get("level"), "timestamp": event.get("timestamp"),
                                         "messages_tokens": used, "tokens_left": left,
                                         "turns": state.get("turns"), "rolled_back_to": event.get("rolled_back_to")})
            if event.get("reason") == "rollback":
                timeline.rollbacks.append({"seq": event["seq"], "to_seq": event.get("rolled_back_to"),
                                           "timestamp": event.get("timestamp"), "after_points": len(timeline.points)})
        elif kind == EventType.RESPONSE.value:
            timeline.points.append({"turn": event.get("turn"), "tokens_in": event.get("tokens_in"),
                                    "tokens_out": event.get("tokens_out"), "prompt_tokens": event.get("prompt_tokens"),
                                    "budget": budget, "levels": levels, "timestamp": event.get("timestamp"),
                                    "model": event.get("model")})
            levels = []
    return timeline


class TimelineCache:
    """Timelines by their log's version (`WalLog.version`: file sizes and times, a stream's
    last entry): a dashboard that polls a quiet session reads its log once."""

    def __init__(self, log: WalLog) -> None:
        self.log = log
        self._cached: dict[tuple[str, str], tuple[tuple[Any, ...], Timeline]] = {}
        self._lock = threading.Lock()  # get() runs in worker threads

    def version(self, tenant: str, session: str) -> tuple[Any, ...]:
        return self.log.version(tenant, session)

    def has_log(self, tenant: str, session: str) -> bool:
        return self.log.exists(tenant, session)

    def get(self, tenant: str, session: str) -> Timeline:
        """Blocking reads (files or Redis): call it in a thread."""
        signature = self.log.version(tenant, session)
        cached = self._cached.get((tenant, session))
        if cached is not None and cached[0] == signature:
            return cached[1]
        events: list[dict[str, Any]] = []
        for scan in self.log.history(tenant, session).scans:
            last = events[-1]["seq"] if events else 0
            events += [e for e in scan.events if e["seq"] > last]  # an archived seq is read once
        timeline = build(events)
        with self._lock:
            self._cached.pop((tenant, session), None)
            self._cached[(tenant, session)] = (signature, timeline)
            while len(self._cached) > CACHED_LOGS:
                self._cached.pop(next(iter(self._cached)))
        return timeline
