"""POST /v1/chat/completions: one turn, as DESIGN.md's data flow describes it."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from aiohttp import web

from .compaction import Plan, Turn, fingerprints_of
from .errors import ApiError
from .gateway import Gateway
from .routing import Route
from .state import SessionState
from .tenancy import Caller, resolve_caller, resolve_session
from .upstream import ContextTooLong, Reply, UpstreamError
from .validation import read_json_body, validate_chat_request

log = logging.getLogger("ctxgate.chat")
_USAGE_TAIL = 16_384


class ChatHandler:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        body = await read_json_body(request)
        validate_chat_request(body)
        caller = resolve_caller(self.gw.config, request.headers)
        route = self.gw.router.resolve(body["model"])
        session_id = resolve_session(caller.tenant, request.headers, body)
        headers = {"X-Ctx-Session": session_id}
        try:
            return await self._turn(request, body, caller, route, session_id, headers, started)
        except ApiError as e:
            self.gw.metrics.requests.labels(route.model_name, str(e.status)).inc()
            e.headers.update(headers)
            raise

    async def _turn(self, request: web.Request, body: dict[str, Any], caller: Caller, route: Route,
                    session_id: str, headers: dict[str, str], started: float) -> web.StreamResponse:
        gw = self.gw
        messages = body["messages"]
        counter = gw.tokenizers.for_model(route.model_name, route.upstream_model)
        fps = fingerprints_of(messages)
        tokens_in = counter.count_request(messages, body.get("tools"), fps)
        config = gw.pipeline_config(caller.profile, caller.tenant)
        summarizer = config.autocompact.model or route.model_name
        turn = Turn(messages=messages, fingerprints=fps, tools=body.get("tools"), counter=counter, config=config,
                    max_input_tokens=caller.budget or route.max_input_tokens,
                    summarize=lambda msgs: gw.summarize(summarizer, msgs))
        headers.update({"X-Ctx-Tokens-In": str(tokens_in), "X-Ctx-Tokenizer": counter.name})
        async with gw.sessions.lock(caller.tenant, session_id):
            state = await gw.sessions.load(caller.tenant, session_id) or SessionState(caller.tenant, session_id)
            try:
                plan = await gw.compactor.prepare(state, turn)
            finally:
                guard_set = state.has_attempted_reactive_compact
                state.turns += 1
                await gw.sessions.save(state)
        stream = bool(body.get("stream"))
        api_key = caller.bearer if caller.tenant_config.pass_through_key else route.api_key
        upstream_ms, levels, degraded = 0.0, list(plan.levels), False
        while True:
            payload = {**route.call_params, **body, "model": route.upstream_model, "messages": plan.messages}
            try:
                reply = await gw.forwarder_for(route).send(route, payload, stream=stream, api_key=api_key)
                break
            except ContextTooLong as e:
                async with gw.sessions.lock(caller.tenant, session_id):
                    state = await gw.sessions.load(caller.tenant, session_id) or SessionState(caller.tenant, session_id)
                    try:
                        plan, degraded = await gw.compactor.reactive(state, turn, plan, e.body["error"]["message"], degraded)
                    finally:
                        guard_set = state.has_attempted_reactive_compact
                        await gw.sessions.save(state)
                levels += [lv for lv in plan.levels if lv not in levels]
            except UpstreamError as e:  # the upstream's own status and error object, in OpenAI's shape
                raise e.to_api_error() from None
        upstream_ms += reply.upstream_ms
        headers.update({"X-Ctx-Tokens-Out": str(plan.tokens_out), "X-Ctx-Levels": ",".join(levels) or "none"})
        if reply.chunks is None:
            overhead = (time.perf_counter() - started) * 1000 - upstream_ms
            headers["X-Ctx-Overhead-Ms"] = f"{max(0.0, overhead):.2f}"
            response = web.Response(status=reply.status, body=reply.body, headers={"Content-Type": reply.content_type, **headers})
            await self._after_reply(caller, session_id, route, plan, _usage_of(reply.body), overhead, guard_set)
            return response
        return await self._stream(request, reply, headers, started, upstream_ms, caller, session_id, route, plan,
                                  guard_set)

    async def _stream(self, request: web.Request, reply: Reply, headers: dict[str, str], started: float,
                      upstream_ms: float, caller: Caller, session_id: str, route: Route, plan: Plan,
                      guard_set: bool) -> web.StreamResponse:
        overhead = (time.perf_counter() - started) * 1000 - upstream_ms
        headers["X-Ctx-Overhead-Ms"] = f"{max(0.0, overhead):.2f}"
        response = web.StreamResponse(status=reply.status, headers={
            "Content-Type": reply.content_type, "Cache-Control": "no-cache", **headers})
        await response.prepare(request)
        tail, complete = b"", False
        try:
            async for data in reply.chunks:
                await response.write(data)
                tail = (tail + data)[-_USAGE_TAIL:]
            complete = True
        except ApiError as e:
            # Headers are gone already: the error travels as an SSE event, as OpenAI does.
            await response.write(b"data: " + orjson.dumps(e.body()) + b"\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client left session %s mid-stream; upstream call cancelled", session_id)
            raise
        finally:
            if reply.close is not None:
                reply.close()
        if complete:
            await self._after_reply(caller, session_id, route, plan, _usage_in_sse(tail), overhead, guard_set)
        await response.write_eof()
        return response

    async def _after_reply(self, caller: Caller, session_id: str, route: Route, plan: Plan,
                           prompt_tokens: int | None, overhead_ms: float, guard_set: bool) -> None:
        gw = self.gw
        gw.metrics.requests.labels(route.model_name, "200").inc()
        gw.metrics.overhead.observe(overhead_ms)
        if prompt_tokens is not None:
            gw.metrics.calibrate(route.model_name, plan.tokens_out, prompt_tokens)
        if guard_set:
            await self._reset_guard(caller.tenant, session_id)

    async def _reset_guard(self, tenant: str, session_id: str) -> None:
        """A complete reply arrived: the loop guard may compact again (spec pitfall 2)."""
        async with self.gw.sessions.lock(tenant, session_id):
            state = await self.gw.sessions.load(tenant, session_id)
            if state is not None and state.has_attempted_reactive_compact:
                state.has_attempted_reactive_compact = False
                await self.gw.sessions.save(state)


def _usage_of(body: bytes | None) -> int | None:
    if not body or b'"usage"' not in body:
        return None
    try:
        usage = orjson.loads(body).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) else None


def _usage_in_sse(tail: bytes) -> int | None:
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            found = _usage_of(line[6:])
            if found is not None:
                return found
    return None
