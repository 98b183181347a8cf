"""Deleting a user's or a session's data (docs/memory.md and docs/wal.md, Deleting a user's
or a session's data): `DELETE /v1/ctx/sessions/{id}` and `DELETE /v1/ctx/users/{user}`, for
the caller's tenant only.

A session's data is everywhere a turn left it: the session state, its WAL (live log,
archives, the SQLite mirror's rows), the expansion originals, the short-term memory buffer,
long-term memory entries whose provenance names it, stored Responses replies and
Idempotency-Key replies made in it, and the in-process history cache. It is erased under
the session's lock, so a turn in flight finishes first and a turn that comes after starts
a new session rather than finding half of the old one. A user's data is every session
that named the user (the state's `users`, the WAL's), every memory entry whose provenance
names the user, and the user's own user-scoped entries.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import orjson
from aiohttp import web

from ..doors.response_store import ResponseStore
from ..engine.state import reachable
from ..errors import ErrorKind, GatewayError
from ..gateway import Gateway
from ..ids import require_id
from ..tenancy import resolve_caller

log = logging.getLogger("ctxgate.erase")


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


class Eraser:
    def __init__(self, gw: Gateway, responses: ResponseStore) -> None:
        self.gw = gw
        self.responses = responses

    async def session(self, tenant: str, session_id: str) -> Counter[str]:
        """Everything of one session, under its lock; what was removed, per kind."""
        gw, key = self.gw, (tenant, session_id)
        removed: Counter[str] = Counter()
        if gw.memory is not None:  # a consolidation logs to the session, locked: it ends first
            await gw.memory.settled(key)
        with reachable():
            async with gw.sessions.store.lock(tenant, session_id):
                removed["sessions"] += await gw.sessions.store.erase(tenant, session_id)
                removed.update(await gw.journal.erase(tenant, session_id))
                removed["expansion_originals"] += await gw.compactor.content.erase(tenant, session_id)
                gw.histories.forget(tenant, session_id)
                if gw.memory is not None:  # a capture started by the turn before this lock ends first
                    removed["short_term_candidates"] += await gw.memory.discard_session(key)
        return removed

    async def entries(self, tenant: str, *, user: str | None = None, session: str | None = None) -> int:
        """The memory entries whose provenance names the user or session (and the user's own)."""
        if self.gw.memory is None:
            return 0
        store = self.gw.memory.store
        with reachable():
            named = [e for e in await store.list(tenant) if e.names(user=user, session=session)]
            for entry in named:
                await store.delete(tenant, entry.id)
        return len(named)

    async def replies(self, tenant: str, sessions: set[str]) -> Counter[str]:
        with reachable():
            return Counter({"responses": await self.responses.erase_sessions(tenant, sessions),
                            "idempotent_replies": await self.gw.idempotency.erase_sessions(tenant, sessions)})

    async def sessions_of(self, tenant: str, user: str) -> set[str]:
        """The sessions whose state or WAL names the user, and those memory provenance ties to them."""
        gw = self.gw
        with reachable():
            found = {s.session_id for s in await gw.sessions.store.list(tenant) if user in s.users}
            logs = await asyncio.to_thread(gw.journal.writer.sessions, tenant)
            for info in logs:
                if info.tenant == tenant and info.session not in found and \
                        user in await asyncio.to_thread(gw.journal.users, tenant, info.session):
                    found.add(info.session)
            if gw.memory is not None:
                found |= {p.session for e in await gw.memory.store.list(tenant) for p in e.provenance
                          if p.user == user and p.session is not None}
        return found

    # -- HTTP ------------------------------------------------------------------------------

    async def delete_session(self, request: web.Request) -> web.Response:
        tenant = resolve_caller(self.gw.config, request.headers).tenant
        session_id = require_id(request.match_info["session_id"], "session", "session_id")
        removed = await self.session(tenant, session_id)
        removed.update(await self.replies(tenant, {session_id}))
        removed["memory_entries"] += await self.entries(tenant, session=session_id)
        if not any(removed.values()):
            raise GatewayError(ErrorKind.NOT_FOUND, f"no session {session_id} for this tenant",
                               code="session_not_found")
        log.info("deleted the data of session %s/%s: %s", tenant, session_id, dict(removed))
        return _json({"id": session_id, "object": "session.deleted", "deleted": True, "removed": _summary(removed)})

    async def delete_user(self, request: web.Request) -> web.Response:
        tenant = resolve_caller(self.gw.config, request.headers).tenant
        user = require_id(request.match_info["user"], "user", "user")
        started = time.monotonic()
        sessions = sorted(await self.sessions_of(tenant, user))
        removed: Counter[str] = Counter()
        for session_id in sessions:
            removed.update(await self.session(tenant, session_id))
        removed.update(await self.replies(tenant, set(sessions)))
        removed["memory_entries"] += await self.entries(tenant, user=user)
        for session_id in sessions:  # entries of those sessions that name no user (made before users were kept)
            removed["memory_entries"] += await self.entries(tenant, session=session_id)
        if not sessions and not any(removed.values()):
            raise GatewayError(ErrorKind.NOT_FOUND, f"no data of user {user} for this tenant", code="user_not_found")
        log.info("deleted the data of user %s/%s (%d sessions, %.1f s): %s", tenant, user, len(sessions),
                 time.monotonic() - started, dict(removed))
        return _json({"id": user, "object": "user.deleted", "deleted": True, "sessions": sessions,
                      "removed": _summary(removed)})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_delete("/v1/ctx/sessions/{session_id}", self.delete_session)
        app.router.add_delete("/v1/ctx/users/{user}", self.delete_user)


KINDS = ("sessions", "wal_logs", "wal_archives", "wal_mirror_rows", "expansion_originals", "short_term_candidates",
         "memory_entries", "responses", "idempotent_replies")


def _summary(removed: Counter[str]) -> dict[str, int]:
    """Every kind, zero included, in one order: a script reads the same keys every time."""
    return {kind: int(removed[kind]) for kind in KINDS}
