"""What every door does around the turn engine: idempotent retries, the whole or streamed
reply to the client, and the turn's bookkeeping even when the client hangs up early."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine

from aiohttp import web
from multidict import CIMultiDict

from ..engine.expansion import ExpandingWire, expanded
from ..engine.idempotency import HEADER as IDEMPOTENCY_HEADER, StoredReply, key_of, request_hash
from ..engine.prepared import PreparedTurn, TurnInput
from ..engine.turn import TurnEngine
from ..engine.wire import ReplyFacts, Wire
from ..errors import ErrorKind, GatewayError
from .errors import http_status
from .sse import SseEvents
from ..tenancy import Caller
from ..upstream.errors import BAD_REPLY
from ..upstream.forwarders import Reply
from ..upstream.routing import Route

log = logging.getLogger("ctxgate.doors")
SESSION_PREFIX = "/s/{ctx_session}"
"""A base URL that names the session: `http://host/s/<id>/v1`. An agent that takes its base
URL from the environment but no headers (the OpenAI SDK reads OPENAI_BASE_URL) is given its
session this way (`ctxgate run` does)."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def shaped_errors(handler: Handler, render: Callable[[GatewayError], web.StreamResponse]) -> Handler:
    """`handler` with every failure, whatever raised it (the caller, the body, the route, the
    engine), answered by `render` in its door's error shape, with the error's own headers."""
    async def handle(http: web.Request) -> web.StreamResponse:
        try:
            return await handler(http)
        except GatewayError as e:
            error = e
        except ConnectionResetError:  # the client is gone: nobody to answer
            raise
        except Exception:
            log.exception("internal error on %s %s", http.method, http.path)
            error = GatewayError(ErrorKind.INTERNAL, "internal error in ctxgate; it is logged on the server")
        return render(error)
    return handle


def add_door_route(app: web.Application, method: str, path: str, handler: Handler) -> None:
    """`path`, and the same under `SESSION_PREFIX`, where the path's session is the request's
    `X-Ctx-Session` unless the request names one itself."""
    app.router.add_route(method, path, handler)
    app.router.add_route(method, SESSION_PREFIX + path, _session_from_path(handler))


def _session_from_path(handler: Handler) -> Handler:
    async def handle(http: web.Request) -> web.StreamResponse:
        if "X-Ctx-Session" not in http.headers:
            headers = CIMultiDict(http.headers)
            headers["X-Ctx-Session"] = http.match_info["ctx_session"]
            http = http.clone(headers=headers)
        return await handler(http)
    return handle


@dataclass
class DoorRequest:
    """One parsed request at a door: who asks, where it goes, and the turn it is."""
    http: web.Request
    caller: Caller
    route: Route
    session_id: str
    turn: TurnInput
    wire_body: dict[str, Any]
    """The body as the client sent it: an idempotency key reused with another body is refused."""
    started: float


async def answer(engine: TurnEngine, request: DoorRequest, wire: Wire) -> web.StreamResponse:
    """The turn, answered: from the stored reply for a retried idempotency key, else by the engine."""
    headers = {"X-Ctx-Session": request.session_id}
    try:
        key = key_of(request.http.headers)
        if key is None:
            return await _turn(engine, request, wire, headers, None)
        store = engine.gw.idempotency
        async with store.in_flight.hold(request.caller.tenant, key):
            stored = await store.get(request.caller.tenant, key)
            if stored is None:
                return await _turn(engine, request, wire, headers, key)
            if stored.request_hash != request_hash(request.wire_body):
                raise GatewayError(ErrorKind.CONFLICT,
                                   f"{IDEMPOTENCY_HEADER} {key!r} was already used with a different request body",
                               param=IDEMPOTENCY_HEADER, code="idempotency_key_reused")
            engine.gw.metrics.idempotent_replays.inc()
            return web.Response(status=stored.status, body=stored.body, headers={
                **stored.headers, "Content-Type": stored.content_type, "Idempotent-Replayed": "true"})
    except GatewayError as e:
        engine.gw.metrics.requests.labels(request.route.model_name, str(http_status(e))).inc()
        e.headers.update(headers)
        raise


async def _forwarded(engine: TurnEngine, request: DoorRequest, wire: Wire,
                     headers: dict[str, str]) -> tuple[PreparedTurn, Reply]:
    """The turn planned for its model and sent; when that model fails before any byte of a
    reply (after its own retries), or the turn cannot fit it, planned again for the next
    fallback model group the config names, and sent there (`upstream/fallbacks.py`)."""
    gw, route, tried = engine.gw, request.route, [request.route.model_name]
    while True:
        try:
            prepared = await engine.prepare(request.caller, route, request.session_id, request.turn, wire, headers,
                                            request.started)
            return prepared, await engine.forward(prepared, wire, request.turn.stream)
        except GatewayError as e:
            found = gw.router.fallbacks.candidates(request.route.model_name, e)
            following = [name for name in found[0] if name not in tried] if found else []
            if not following:
                raise
            failed, route = route.model_name, gw.router.resolve(following[0])
            tried.append(route.model_name)
            assert found is not None
            gw.retrier.fell_back(failed, route.model_name, found[1])
            log.warning("session %s: %s failed (%s: %s); falling back to %s", request.session_id, failed, found[1],
                        e.message[:200], route.model_name)
            headers["X-Ctx-Fallback"] = route.model_name


async def _turn(engine: TurnEngine, request: DoorRequest, wire: Wire, headers: dict[str, str],
                idempotency_key: str | None) -> web.StreamResponse:
    prepared, reply = await _forwarded(engine, request, wire, headers)
    if prepared.expansion is not None and isinstance(wire, ExpandingWire):
        reply = await expanded(prepared, wire, reply)
    done = _Settle(engine, prepared, wire, request, idempotency_key)
    if reply.chunks is None:
        headers["X-Ctx-Overhead-Ms"] = f"{prepared.overhead_ms():.2f}"
        body = reply.body or b""
        facts = wire.reply_facts(body)
        if facts.malformed is not None:  # not an answer: nothing is settled, the client gets a 502
            raise _failed(prepared, wire, GatewayError(
                ErrorKind.UPSTREAM_UNREACHABLE, f"upstream for {prepared.route.model_name} answered HTTP "
                f"{reply.status} with a body that is not a {wire.name} reply ({facts.malformed})",
                code=BAD_REPLY, headers=dict(reply.headers)))
        try:
            await _uncancellable(done(reply, body, facts))
        finally:  # once aiohttp has written the reply: it does so without yielding after the handler returns
            asyncio.get_running_loop().call_soon(prepared.finish)
        return web.Response(status=reply.status, body=reply.body, headers={
            "Content-Type": reply.content_type, **reply.headers, **headers})
    return await _relay(request.http, reply, done, wire)


async def _relay(http: web.Request, reply: Reply, done: "_Settle", wire: Wire) -> web.StreamResponse:
    """The stream, relayed in whole events checked as they pass (`SseEvents`): an event that
    is not JSON ends it with the API's error event, and so does an end without the API's
    last event; neither is settled as an answered turn."""
    assert reply.chunks is not None
    prepared = done.prepared
    prepared.headers["X-Ctx-Overhead-Ms"] = f"{prepared.overhead_ms():.2f}"
    response = web.StreamResponse(status=reply.status, headers={
        "Content-Type": reply.content_type, "Cache-Control": "no-cache", **reply.headers, **prepared.headers})
    await response.prepare(http)
    watch, events = wire.stream_watch(keep_all=done.idempotency_key is not None), SseEvents()
    settled, open_event, ended_by_error = False, False, False

    async def relay(data: bytes) -> None:
        nonlocal settled
        watch.feed(data)
        if not settled and watch.complete and not watch.failed:
            # An SDK hangs up as soon as it reads the last event: the turn's bookkeeping comes first.
            settled = True
            await _uncancellable(done(reply, watch.body(), watch.facts()))
        await response.write(data)

    try:
        async for data in reply.chunks:
            ready, problem = events.push(data)
            if ready:
                await relay(ready)
            if problem is not None:
                raise _broken(prepared, problem)
        rest, problem = events.rest()
        if problem is not None:
            raise _broken(prepared, problem)
        if rest:
            await relay(rest)
            open_event = True
        if not watch.complete and not watch.failed:
            raise GatewayError(ErrorKind.UPSTREAM_UNREACHABLE, f"upstream for {prepared.route.model_name} ended "
                               f"the stream before its last event: the reply is incomplete",
                               code="upstream_incomplete")
    except GatewayError as e:
        # The headers are gone already: the error travels as the API's own stream error event
        # (after a blank line when the upstream left an event unfinished).
        await response.write((b"\n\n" if open_event else b"") + wire.error_event(e))
        ended_by_error = True
        if not settled:
            _failed(prepared, wire, e)
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client left session %s mid-stream; upstream call cancelled", prepared.session_id)
        if settled:
            prepared.finish()
        raise
    finally:
        if reply.close is not None:
            reply.close()
    if (watch.failed or ended_by_error) and not settled:  # not a reply: nothing settled
        done.engine.gw.metrics.requests.labels(prepared.route.model_name, "stream_error").inc()
    try:
        await response.write_eof()
    finally:
        if settled:
            prepared.finish()
    return response


def _broken(prepared: PreparedTurn, problem: str) -> GatewayError:
    return GatewayError(ErrorKind.UPSTREAM_UNREACHABLE,
                        f"upstream for {prepared.route.model_name} sent {problem}", code=BAD_REPLY)


def _failed(prepared: PreparedTurn, wire: Wire, error: GatewayError) -> GatewayError:
    """An upstream reply that is not an answer, logged as such (the turn is not settled: no
    RESPONSE in the WAL, the loop guard stays, no stored reply for a retry)."""
    log.warning("session %s: upstream failure on the %s door (%s): %s", prepared.session_id, wire.name,
                error.code, error.message)
    return error


@dataclass
class _Settle:
    """The end of a turn whose upstream call completed: the engine's bookkeeping, then the
    reply kept for a retry of the same idempotency key."""
    engine: TurnEngine
    prepared: PreparedTurn
    wire: Wire
    request: DoorRequest
    idempotency_key: str | None

    async def __call__(self, reply: Reply, body: bytes, facts: ReplyFacts) -> None:
        await self.engine.settle(self.prepared, self.wire, reply.status, facts)
        if self.idempotency_key is not None:
            stored = StoredReply(request_hash(self.request.wire_body), reply.status, reply.content_type, body,
                                 dict(self.prepared.headers), time.time())
            await self.engine.gw.idempotency.put(self.request.caller.tenant, self.idempotency_key, stored)


async def _uncancellable(work: Coroutine[Any, Any, None]) -> None:
    """Finish the bookkeeping of a completed upstream call even when the client leaves
    (an SDK closes the connection at its last event): the log and the stored reply must
    not depend on when the client hangs up."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise
