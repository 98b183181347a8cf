"""The aiohttp application: routes, the error middleware, start and stop."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import orjson
from aiohttp import web

from .doors.chat import ChatDoor
from .doors.errors import openai_response
from .doors.respond import add_door_route
from .doors.unknown import not_found
from .doors import gemini as gemini_door
from .doors import messages as messages_door
from .doors import responses as responses_door
from .errors import ErrorKind, GatewayError
from .gateway import Gateway
from .ids import InvalidId, validate_id
from .admin.erase import Eraser
from .admin.memory_api import MemoryApi
from .admin.metrics import authorize_metrics
from .admin.rollback import requested_seq, roll_back
from .admin.ui import Dashboard
from .connections import guard_requests
from .engine.state import reachable
from .tenancy import resolve_caller

log = logging.getLogger("ctxgate")
GATEWAY = web.AppKey("gateway", Gateway)
HOUSEKEEPING = web.AppKey("housekeeping", asyncio.Task)
STARTED = web.AppKey("started", float)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


@web.middleware
async def openai_errors(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """Every failure leaves in OpenAI's error shape; no traceback ever reaches a client."""
    try:
        return await handler(request)
    except GatewayError as e:
        return openai_response(e)
    except web.HTTPRequestEntityTooLarge:
        return openai_response(GatewayError(ErrorKind.TOO_LARGE, f"request body is larger than the limit of "
                                            f"{request.client_max_size} bytes", code="request_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:  # no door here: the client is told which APIs ctxgate serves
            return not_found(request)
        # aiohttp's own (no route, wrong method): its status as an upstream's would be.
        return openai_response(GatewayError(ErrorKind.UPSTREAM, e.reason or "request failed", upstream_status=e.status))
    except (ConnectionResetError, OSError) as e:
        if request.transport is None or request.transport.is_closing():
            raise
        log.exception("I/O failure on %s %s", request.method, request.path)
        return openai_response(GatewayError(ErrorKind.UPSTREAM_UNREACHABLE, f"I/O failure: {type(e).__name__}",
                                            code="io_error"))
    except Exception:
        request_id = uuid.uuid4().hex[:16]  # what an operator greps the log for, from the client's error
        log.exception("internal error on %s %s (request %s)", request.method, request.path, request_id)
        return openai_response(GatewayError(ErrorKind.INTERNAL, f"internal error in ctxgate (request {request_id}); "
                                            "it is logged on the server", code="internal_error",
                                            headers={"X-Request-Id": request_id}))


@web.middleware
async def refuse_websocket(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """An agent that tries a WebSocket transport (Codex's Responses WebSocket) gets a clear 400
    at once, on which it falls back to HTTP, rather than a method error or a wait."""
    if request.headers.get("Upgrade", "").lower() == "websocket":
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"ctxgate serves {request.path} over HTTP only: WebSocket "
                           "transports are not proxied; send the request as an HTTP POST (Codex: a model provider "
                           "with wire_api = \"responses\")", code="websocket_unsupported")
    return await handler(request)


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if not await gw.sessions.ping():
        return _json({"status": "state backend unreachable"}, 503)
    if not await asyncio.to_thread(gw.journal.writer.ping):  # the log may live in a Redis of its own
        return _json({"status": "session log unreachable"}, 503)
    return _json({"status": "ready"})


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    created = int(request.app[STARTED])
    data = [{"id": name, "object": "model", "created": created, "owned_by": "ctxgate"}
            for name in gw.router.model_names()]
    return _json({"object": "list", "data": data})


async def metrics(request: web.Request) -> web.Response:
    authorize_metrics(request.app[GATEWAY].config, request.headers)
    return web.Response(body=request.app[GATEWAY].metrics.exposition(), content_type="text/plain")


def _session_of(request: web.Request) -> tuple[Gateway, str, str]:
    gw = request.app[GATEWAY]
    caller = resolve_caller(gw.config, request.headers)
    try:
        session_id = validate_id(request.match_info["session_id"], "session")
    except InvalidId as e:
        raise GatewayError(ErrorKind.INVALID_REQUEST, str(e), code="invalid_session") from None
    return gw, caller.tenant, session_id


async def session_summary(request: web.Request) -> web.Response:
    gw, tenant, session_id = _session_of(request)
    state = await gw.sessions.read(tenant, session_id)
    if state is None:
        raise GatewayError(ErrorKind.NOT_FOUND, f"no session {session_id} for this tenant", code="session_not_found")
    return _json({"id": state.session_id, "tenant": state.tenant, "turns": state.turns,
                  "answered_turns": state.answered_turns, "unanswered_turns": state.turns - state.answered_turns,
                  "created_at": state.created_at,
                  "updated_at": state.updated_at, "records": [
                      {"prefix_len": r.prefix_len, "levels": r.levels, "tokens_before": r.tokens_before,
                       "tokens_after": r.tokens_after} for r in state.records],
                  "has_attempted_reactive_compact": state.has_attempted_reactive_compact,
                  "count_offset": state.count_offset, "count_scale": state.count_scale,
                  "dialect": state.dialect or "plain",
                  "compactions": state.compaction_log[-50:], "working": state.working, "wal_seq": state.wal_seq})


async def session_checkpoints(request: web.Request) -> web.Response:
    gw, tenant, session_id = _session_of(request)
    return _json({"object": "list", "data": await asyncio.to_thread(gw.journal.checkpoints, tenant, session_id)})


async def session_rollback(request: web.Request) -> web.Response:
    """Restore a session to one of its WAL checkpoints: `{"to_seq": N}`."""
    gw, tenant, session_id = _session_of(request)
    to_seq = requested_seq(await request.read())
    state = await roll_back(gw, tenant, session_id, to_seq)
    return _json({"id": session_id, "rolled_back_to": to_seq, "wal_seq": state.wal_seq,
                  "records": len(state.records), "turns": state.turns})


async def session_end(request: web.Request) -> web.Response:
    """The agent is done: consolidate the session's short-term memory now (auto-dream trigger B)."""
    gw, tenant, session_id = _session_of(request)
    if await gw.sessions.read(tenant, session_id) is None:
        raise GatewayError(ErrorKind.NOT_FOUND, f"no session {session_id} for this tenant", code="session_not_found")
    with reachable():  # short-term buffers in Redis: away, a 503 to retry, never a 500
        event = await gw.memory.end_session((tenant, session_id)) if gw.memory is not None else None
    return _json({"id": session_id, "ended": True, "auto_dream": event})


def create_app(gw: Gateway) -> web.Application:
    # openai_errors outermost: a body over the size limit, met while guard_requests reads it, is its 413.
    guard = guard_requests(gw.config.ctxgate.connections.body_read_timeout_s)
    app = web.Application(middlewares=[openai_errors, refuse_websocket, guard],
                          client_max_size=gw.config.ctxgate.max_body_bytes)
    app[GATEWAY] = gw
    app[STARTED] = time.time()
    chat = ChatDoor(gw).__call__  # the bound coroutine function: aiohttp warns on other callables
    add_door_route(app, "POST", "/v1/chat/completions", chat)
    add_door_route(app, "POST", "/chat/completions", chat)
    add_door_route(app, "GET", "/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/ctx/sessions/{session_id}", session_summary)
    app.router.add_get("/v1/ctx/sessions/{session_id}/checkpoints", session_checkpoints)
    app.router.add_post("/v1/ctx/sessions/{session_id}/rollback", session_rollback)
    app.router.add_post("/v1/ctx/sessions/{session_id}/end", session_end)
    MemoryApi(gw).add_routes(app)
    Dashboard(gw).add_routes(app)
    messages_door.add_routes(app, gw)
    gemini_door.add_routes(app, gw)
    Eraser(gw, responses_door.add_routes(app, gw)).add_routes(app)

    async def _start(app: web.Application) -> None:
        app[HOUSEKEEPING] = asyncio.create_task(gw.housekeeping())

    async def _close(app: web.Application) -> None:
        app[HOUSEKEEPING].cancel()
        await asyncio.gather(app[HOUSEKEEPING], return_exceptions=True)
        await gw.close()

    app.on_startup.append(_start)
    app.on_cleanup.append(_close)
    return app
