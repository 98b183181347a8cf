"""The sessions a dashboard viewer sees, with their live figures.

A session is listed when the state store holds it or when it has a live WAL (a session
written before a restart and not asked for since). Figures come from its state (turns,
the compaction log) and from its WAL timeline (tokens, summary calls, cache-stable share).
"""
from __future__ import annotations

import asyncio
from typing import Any

from ctxgate.pipeline.policy import Prices
from ..engine.state import SessionState
from ..errors import GatewayError
from ..gateway import Gateway
from ..ids import is_valid_id
from .ui_auth import Viewer
from .ui_timeline import CACHED_LOGS, SUMMARY_LEVELS, Timeline, TimelineCache

MAX_LISTED = 500
"""The deepest a listing reaches (offset plus page), newest first; a dashboard is not an export."""
PAGE = 50
"""Sessions per page unless the request asks for another size: figures are computed per page."""
_NOT_COMPACTIONS = ("chain", "rollback")
"""Compaction-log entries that are not a level firing: the chain's total and a rollback."""


class SessionFigures:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.timelines = TimelineCache(gw.journal.writer)
        self._recovered: dict[tuple[str, str], tuple[tuple[Any, ...], SessionState]] = {}

    async def timeline(self, tenant: str, session: str) -> Timeline:
        return await asyncio.to_thread(self.timelines.get, tenant, session)

    async def visible(self, viewer: Viewer, offset: int = 0, limit: int = PAGE) -> tuple[list[dict[str, Any]], bool]:
        """One page of the sessions `viewer` may see, most recently updated first, with their
        figures, and whether there are more after it. Only the page's sessions are figured."""
        depth = min(offset + limit + 1, MAX_LISTED)
        held = {s.key: s for s in await self.gw.sessions.store.list(viewer.tenant, depth)}
        logs = await asyncio.to_thread(self.gw.journal.writer.sessions, viewer.tenant)
        for tenant, session in ((info.tenant, info.session) for info in logs):
            # Names read from disk must follow the id rule before they reach a page or a URL.
            if (tenant, session) not in held and is_valid_id(tenant) and is_valid_id(session) \
                    and viewer.sees(tenant):
                state = await self._from_log(tenant, session)
                if state is not None:
                    held[(tenant, session)] = state
        states = sorted(held.values(), key=lambda s: s.updated_at, reverse=True)[:depth]
        page = states[offset:offset + limit]
        return [await self.figures(state) for state in page], len(states) > offset + limit

    async def state(self, tenant: str, session: str) -> SessionState | None:
        """For reading only, without the session's lock: a dashboard never waits for a turn."""
        return await self.gw.sessions.store.load(tenant, session) or await self._from_log(tenant, session)

    async def _from_log(self, tenant: str, session: str) -> SessionState | None:
        """The state a restart would rebuild, rebuilt again only when the log changed."""
        stamp = await asyncio.to_thread(self.timelines.version, tenant, session)
        cached = self._recovered.get((tenant, session))
        if cached is not None and cached[0] == stamp:
            return cached[1]
        state = await self.gw.journal.recover(tenant, session)
        if state is not None:
            self._recovered.pop((tenant, session), None)
            self._recovered[(tenant, session)] = (stamp, state)
            while len(self._recovered) > CACHED_LOGS:
                self._recovered.pop(next(iter(self._recovered)))
        return state

    async def figures(self, state: SessionState) -> dict[str, Any]:
        tenant, session = state.key
        compactions = [e for e in state.compaction_log if e.get("level") not in _NOT_COMPACTIONS]
        last = compactions[-1] if compactions else {}
        figures: dict[str, Any] = {
            "tenant": tenant, "id": session, "turns": state.turns, "answered_turns": state.answered_turns,
            "failed_turns": max(0, state.turns - state.answered_turns), "created_at": state.created_at,
            "updated_at": state.updated_at, "profile": state.profile or None, "dialect": state.dialect or "plain",
            "records": len(state.records), "last_level": last.get("level"), "last_compaction_at": last.get("at"),
            "tokens_in": None, "tokens_out": None, "cache_stable_share": None, "points_per_100_turns": None,
            "summaries_per_point": None, "cache_read_tokens": None, "cache_write_tokens": None, "input_cost": None,
            "summary_calls": sum(1 for e in compactions if e.get("level") in SUMMARY_LEVELS), "wal": False}
        if await asyncio.to_thread(self.timelines.has_log, tenant, session):
            timeline = await self.timeline(tenant, session)
            latest = timeline.points[-1] if timeline.points else {}
            figures.update(wal=True, tokens_in=latest.get("tokens_in"), tokens_out=latest.get("tokens_out"),
                           cache_stable_share=timeline.cache_stable_share, summary_calls=timeline.summary_calls,
                           **self._cache_figures(timeline))
        return figures

    def _cache_figures(self, timeline: Timeline) -> dict[str, Any]:
        """Compaction points per 100 turns, summary calls per point, cache reads and writes, and
        what the forwarded requests' input cost at each route's list prices (None when a
        route's prices are unknown; the summary calls are not in it: the log does not count
        their tokens)."""
        points = timeline.compaction_points
        cached = timeline.cache_tokens()
        cost: float | None = 0.0
        for model, read, written in cached:
            prices = self._prices(model)
            if prices is None or cost is None:
                cost = None
                continue
            cost += prices.request(read + written, read)
        return {"points_per_100_turns": 100 * points / len(timeline.points) if timeline.points else None,
                "summaries_per_point": timeline.summary_calls / points if points else None,
                "cache_read_tokens": sum(r for _, r, _ in cached), "cache_write_tokens": sum(w for _, _, w in cached),
                "input_cost": cost if cached else None}

    def _prices(self, model: str | None) -> Prices | None:
        if not model:
            return None
        try:
            return self.gw.router.resolve(model).prices
        except GatewayError:
            return None


def compaction_rows(state: SessionState) -> list[dict[str, Any]]:
    """The session's compaction log, newest first: each level that fired, and each rollback."""
    rows = [{"level": e.get("level"), "tokens_before": e.get("tokens_before"), "tokens_after": e.get("tokens_after"),
             "reason": e.get("reason"), "duration_ms": e.get("duration_ms"), "at": e.get("at"),
             "to_seq": e.get("to_seq")} for e in state.compaction_log if e.get("level") != "chain"]
    return rows[::-1]


def record_rows(state: SessionState) -> list[dict[str, Any]]:
    return [{"prefix_len": r.prefix_len, "levels": r.levels, "tokens_before": r.tokens_before,
             "tokens_after": r.tokens_after, "created_at": r.created_at} for r in state.records]
