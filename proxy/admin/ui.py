"""The dashboard: `GET /ui`, its assets, and the JSON it polls under `/v1/ctx/dashboard/`
(docs/dashboard.md). Everything it shows is read from the running gateway; plotly.js comes
from the installed plotly package, so nothing is fetched from the network."""
from __future__ import annotations

import logging
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from ctxgate.memory.entries import MemoryEntry
from .rollback import requested_seq, roll_back
from ..errors import ErrorKind, GatewayError
from ..gateway import Gateway
from ..ids import InvalidId, validate_id
from ..numbers import whole_number
from .ui_auth import Viewer, loopback_only, viewer_of
from .ui_sessions import MAX_LISTED, PAGE, SessionFigures, compaction_rows, record_rows

log = logging.getLogger("ctxgate.dashboard")

ASSETS = Path(str(files(__package__) / "ui_assets"))
ASSET_TYPES = {"index.html": "text/html", "dashboard.js": "text/javascript", "dashboard.css": "text/css"}
MEMORY_SHOWN = 200
"""A tenant's memory entries shown beside a session, the oldest first."""


def plotly_js() -> Path:
    """plotly.js as the installed plotly package ships it (the same file its offline HTML uses)."""
    return Path(str(files("plotly") / "package_data" / "plotly.min.js"))


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _id(value: str, what: str) -> str:
    try:
        return validate_id(value, what)
    except InvalidId as e:
        raise GatewayError(ErrorKind.INVALID_REQUEST, str(e), param=what, code=f"invalid_{what}") from None


def _bounded(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    """An integer query parameter from `low` to `high`; anything else is a 400 naming it."""
    raw = request.query.get(name)
    if raw is None:
        return default
    return whole_number(raw, name, low, high)


class Dashboard:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.figures = SessionFigures(gw)

    def _viewer(self, request: web.Request) -> Viewer:
        return viewer_of(self.gw.config, request.headers, request.remote, request.host)

    def _session_key(self, request: web.Request) -> tuple[Viewer, str, str]:
        """The session named in the path, when the caller may see it; another tenant's is a 404
        exactly like one that does not exist."""
        viewer = self._viewer(request)
        tenant = _id(request.match_info["tenant"], "tenant")
        session = _id(request.match_info["session_id"], "session")
        if not viewer.sees(tenant):
            raise _no_session(session)
        return viewer, tenant, session

    # -- the page --------------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.StreamResponse:
        loopback_only(self.gw.config, request.remote, request.host)
        return web.FileResponse(ASSETS / "index.html", headers={"Content-Type": "text/html; charset=utf-8"})

    async def asset(self, request: web.Request) -> web.StreamResponse:
        loopback_only(self.gw.config, request.remote, request.host)
        name = request.match_info["name"]
        if name == "plotly.min.js":
            return web.FileResponse(plotly_js(), headers={"Content-Type": "text/javascript; charset=utf-8"})
        kind = ASSET_TYPES.get(name)
        if kind is None:  # only the files above: a name from the URL never becomes a path
            raise GatewayError(ErrorKind.NOT_FOUND, f"no dashboard asset {name!r}", code="not_found")
        return web.FileResponse(ASSETS / name, headers={"Content-Type": f"{kind}; charset=utf-8"})

    # -- JSON ------------------------------------------------------------------------------

    async def viewer(self, request: web.Request) -> web.Response:
        viewer = self._viewer(request)
        return _json({"role": viewer.role, "tenant": viewer.tenant})

    async def sessions(self, request: web.Request) -> web.Response:
        """`?limit=N&offset=M`: one page, newest first (N from 1 to 500, 50 unless given;
        offset + limit at most 500)."""
        viewer = self._viewer(request)
        limit = _bounded(request, "limit", PAGE, 1, MAX_LISTED)
        offset = _bounded(request, "offset", 0, 0, MAX_LISTED - limit)
        page, more = await self.figures.visible(viewer, offset, limit)
        return _json({"object": "list", "data": page, "offset": offset, "limit": limit, "has_more": more})

    async def session(self, request: web.Request) -> web.Response:
        _, tenant, session = self._session_key(request)
        state = await self.figures.state(tenant, session)
        if state is None:
            raise _no_session(session)
        timeline = await self.figures.timeline(tenant, session)
        return _json({**await self.figures.figures(state), "timeline": timeline.points,
                      "rollbacks": timeline.rollbacks, "checkpoints": timeline.checkpoints[::-1],
                      "compactions": compaction_rows(state), "records": record_rows(state)})

    async def rollback(self, request: web.Request) -> web.Response:
        """`{"to_seq": N}`: the session as it was at its checkpoint N (docs/wal.md, Rollback)."""
        _, tenant, session = self._session_key(request)
        if request.content_type != "application/json":  # so another site's page cannot post it without CORS
            raise GatewayError(ErrorKind.INVALID_REQUEST, "the body must be JSON (Content-Type: application/json)",
                               code="invalid_request")
        to_seq = requested_seq(await request.read())
        if await self.gw.sessions.read(tenant, session) is None:
            raise _no_session(session)
        state = await roll_back(self.gw, tenant, session, to_seq)
        log.info("dashboard: session %s/%s rolled back to checkpoint %d", tenant, session, to_seq)
        return _json({"id": session, "tenant": tenant, "rolled_back_to": to_seq, "wal_seq": state.wal_seq,
                      "records": len(state.records), "turns": state.turns})

    async def memory(self, request: web.Request) -> web.Response:
        """A tenant's long-term memory entries (`?tenant=`, a tenant key's own by default)."""
        viewer = self._viewer(request)
        tenant = _id(request.query.get("tenant") or viewer.tenant or "", "tenant")
        if not viewer.sees(tenant):
            raise GatewayError(ErrorKind.NOT_FOUND, f"no tenant {tenant} for this key", code="tenant_not_found")
        if self.gw.memory is None:
            return _json({"object": "list", "data": [], "enabled": False})
        try:
            entries = await self.gw.memory.store.list(tenant, now=time.time())
        except Exception as e:  # the page shows the rest; the cause is in the log
            log.exception("dashboard: the memory store failed")
            raise GatewayError(ErrorKind.UNAVAILABLE, f"the memory store is unavailable ({type(e).__name__})",
                               code="memory_unavailable") from None
        return _json({"object": "list", "data": [_memory_row(e) for e in entries[:MEMORY_SHOWN]], "enabled": True,
                      "total": len(entries)})

    async def metrics(self, request: web.Request) -> web.Response:
        """The last hour per minute. Its counts are the whole gateway's, so a tenant key may not read them."""
        viewer = self._viewer(request)
        if viewer.tenant is not None:
            raise GatewayError(ErrorKind.PERMISSION, "the gateway's metrics are for the admin key",
                               code="admin_only")
        return _json({"object": "list", "data": self.gw.metrics.minutes.last_hour()})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/ui", self.page)
        app.router.add_get("/ui/", self.page)
        app.router.add_get("/ui/{name}", self.asset)
        base = "/v1/ctx/dashboard"
        app.router.add_get(f"{base}/viewer", self.viewer)
        app.router.add_get(f"{base}/sessions", self.sessions)
        app.router.add_get(f"{base}/tenants/{{tenant}}/sessions/{{session_id}}", self.session)
        app.router.add_post(f"{base}/tenants/{{tenant}}/sessions/{{session_id}}/rollback", self.rollback)
        app.router.add_get(f"{base}/memory", self.memory)
        app.router.add_get(f"{base}/metrics", self.metrics)


def _memory_row(e: MemoryEntry) -> dict[str, Any]:
    """An entry as the page shows it: where it came from (the first sighting's source and
    session, every sighting in `provenance`) and whether it may be injected."""
    first = e.provenance[0] if e.provenance else None
    return {"id": e.id, "category": e.category.value, "content": e.content,
            "scope": {"user": e.user, "project": e.project}, "origin": e.origin, "created_at": e.created_at,
            "expires_at": e.expires_at, "status": "quarantined" if e.quarantined else "active",
            "source": first.source if first else None, "session": first.session if first else None,
            "owner": e.owner, "shared": e.shared, "confirmations": e.confirmations,
            "quarantine": e.quarantine.model_dump() if e.quarantine else None,
            "provenance": [p.model_dump(exclude={"tenant"}) for p in e.provenance]}


def _no_session(session: str) -> GatewayError:
    return GatewayError(ErrorKind.NOT_FOUND, f"no session {session} for this key", code="session_not_found")
