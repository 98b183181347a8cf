"""POST /v1/chat/completions: one turn, as DESIGN.md's data flow describes it."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Coroutine

import orjson
from aiohttp import web

from ...memory.short_term import BufferScope
from ..engine.compaction import Plan, Turn, budget_of, count_offset_key, fingerprints_of, measured_offset
from ..errors import ApiError
from ..gateway import Gateway
from ..engine.idempotency import HEADER as IDEMPOTENCY_HEADER, StoredReply, key_of, request_hash
from ..upstream.routing import Route
from ..tenancy import Caller, resolve_caller, resolve_session
from ..engine.memory_turn import MemoryScope, block_tokens, inject, query_of, scope_of
from .chat_replies import ReplyFacts, SseReply, reply_facts
from ..engine.state import SessionState
from ..upstream.forwarders import ContextTooLong, Reply, UpstreamError
from .validation import read_json_body, validate_chat_request

log = logging.getLogger("ctxgate.chat")


class ChatHandler:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        caller = resolve_caller(self.gw.config, request.headers)  # who asks first: a 401 before any 400
        body = await read_json_body(request)
        validate_chat_request(body)
        route = self.gw.router.resolve(body["model"])
        session_id = resolve_session(caller.tenant, request.headers, body)
        headers = {"X-Ctx-Session": session_id}
        idempotency_key = key_of(request.headers)
        try:
            if idempotency_key is not None:
                return await self._idempotent(request, body, caller, route, session_id, headers, started,
                                              idempotency_key)
            return await self._turn(request, body, caller, route, session_id, headers, started, None)
        except ApiError as e:
            self.gw.metrics.requests.labels(route.model_name, str(e.status)).inc()
            e.headers.update(headers)
            raise

    async def _idempotent(self, request: web.Request, body: dict[str, Any], caller: Caller, route: Route,
                          session_id: str, headers: dict[str, str], started: float, key: str) -> web.StreamResponse:
        """A retry of a request whose upstream call completed gets the stored reply, not a second call."""
        store, digest = self.gw.idempotency, request_hash(body)
        async with store.in_flight.hold(caller.tenant, key):
            stored = await store.get(caller.tenant, key)
            if stored is None:
                return await self._turn(request, body, caller, route, session_id, headers, started, (key, digest))
            if stored.request_hash != digest:
                raise ApiError(422, f"{IDEMPOTENCY_HEADER} {key!r} was already used with a different request body",
                               param=IDEMPOTENCY_HEADER, code="idempotency_key_reused")
            self.gw.metrics.idempotent_replays.inc()
            return web.Response(status=stored.status, body=stored.body, headers={
                **stored.headers, "Content-Type": stored.content_type, "Idempotent-Replayed": "true"})

    async def _turn(self, request: web.Request, body: dict[str, Any], caller: Caller, route: Route,
                    session_id: str, headers: dict[str, str], started: float,
                    idempotency: tuple[str, str] | None) -> web.StreamResponse:
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
        memory = gw.memory if gw.memory is not None and gw.memory.enabled(caller.profile) else None
        scope = scope_of(request.headers, body) if memory is not None else None
        plan: Plan | None = None
        block = ""
        offset_key = count_offset_key(route.model_name, turn.tools)
        async with gw.sessions.lock(caller.tenant, session_id):
            state = await gw.load_session(caller.tenant, session_id)
            state.profile = caller.profile
            turn.count_offset = state.count_offset if state.count_offset_key == offset_key else 0
            if memory is not None and scope is not None:
                block = await self._memory_block(state, scope, turn)
                turn.reserved_tokens = block_tokens(block, counter)
            try:
                plan = await gw.compactor.prepare(state, turn)
            finally:
                guard_set = state.has_attempted_reactive_compact
                state.turns += 1
                try:  # before anything is forwarded: what the client sent is in the log first
                    await gw.journal.log_request(state, turn, plan.tokens_out if plan else None,
                                                 budget_of(state, turn))
                finally:
                    await gw.sessions.save(state)
        if memory is not None and scope is not None:
            memory.observe((caller.tenant, session_id), BufferScope(scope.user, scope.project, caller.profile,
                                                                    summarizer), messages, fps, counter.head)
        stream = bool(body.get("stream"))
        api_key = caller.bearer if caller.tenant_config.pass_through_key else route.api_key
        upstream_ms, levels, degraded = 0.0, list(plan.levels), plan.degraded
        while True:
            payload = {**route.call_params, **body, "model": route.upstream_model,
                       "messages": inject(plan.messages, block)}
            try:
                reply = await gw.forwarder_for(route).send(route, payload, stream=stream, api_key=api_key)
                break
            except ContextTooLong as e:
                async with gw.sessions.lock(caller.tenant, session_id):
                    state = await gw.load_session(caller.tenant, session_id)
                    try:
                        plan, degraded = await gw.compactor.reactive(state, turn, plan, e.body["error"]["message"],
                                                                     degraded)
                    finally:
                        guard_set = state.has_attempted_reactive_compact
                        try:
                            await gw.journal.log_request(state, turn, plan.tokens_out, budget_of(state, turn))
                        finally:
                            await gw.sessions.save(state)
                levels += [lv for lv in plan.levels if lv not in levels]
            except UpstreamError as e:  # the upstream's own status and error object, in OpenAI's shape
                raise e.to_api_error() from None
        upstream_ms += reply.upstream_ms
        headers.update({"X-Ctx-Tokens-Out": str(plan.tokens_out), "X-Ctx-Levels": ",".join(levels) or "none"})
        done = _Done(caller, session_id, route, turn, offset_key, plan, guard_set, idempotency, headers)
        if reply.chunks is None:
            overhead = (time.perf_counter() - started) * 1000 - upstream_ms
            headers["X-Ctx-Overhead-Ms"] = f"{max(0.0, overhead):.2f}"
            facts = reply_facts(reply.body)
            await _uncancellable(self._after_reply(done, reply, reply.body or b"", facts, overhead))
            return web.Response(status=reply.status, body=reply.body,
                                headers={"Content-Type": reply.content_type, **headers})
        return await self._stream(request, reply, done, started, upstream_ms)

    async def _memory_block(self, state: SessionState, scope: MemoryScope, turn: Turn) -> str:
        """The session's memory block; a memory store that fails leaves the last one in place."""
        memory = self.gw.memory
        assert memory is not None
        budget = int(budget_of(state, turn) * memory.config.budget_share)
        try:
            version = await memory.store.version(state.tenant)
            return await self.gw.memory_blocks.block(state, version, scope, lambda: memory.context_block(
                state.tenant, scope.user, scope.project, query_of(turn.messages), budget, turn.counter.count))
        except Exception as e:
            log.warning("session %s: memory unavailable (%s); the previous block is kept", state.session_id, e)
            return state.memory_block

    async def _stream(self, request: web.Request, reply: Reply, done: "_Done", started: float,
                      upstream_ms: float) -> web.StreamResponse:
        assert reply.chunks is not None  # _turn answers a reply without chunks itself
        overhead = (time.perf_counter() - started) * 1000 - upstream_ms
        done.headers["X-Ctx-Overhead-Ms"] = f"{max(0.0, overhead):.2f}"
        response = web.StreamResponse(status=reply.status, headers={
            "Content-Type": reply.content_type, "Cache-Control": "no-cache", **done.headers})
        await response.prepare(request)
        stream, complete, settled = SseReply(keep_all=done.idempotency is not None), False, False
        try:
            async for data in reply.chunks:
                stream.feed(data)
                if not settled and b"data: [DONE]" in data:
                    # An SDK hangs up as soon as it reads [DONE]: the turn's bookkeeping comes first.
                    settled = True
                    await _uncancellable(self._after_reply(done, reply, stream.body(), stream.facts(), overhead))
                await response.write(data)
            complete = True
        except ApiError as e:
            # Headers are gone already: the error travels as an SSE event, as OpenAI does.
            await response.write(b"data: " + orjson.dumps(e.body()) + b"\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client left session %s mid-stream; upstream call cancelled", done.session_id)
            raise
        finally:
            if reply.close is not None:
                reply.close()
        if complete and not settled:
            await _uncancellable(self._after_reply(done, reply, stream.body(), stream.facts(), overhead))
        await response.write_eof()
        return response

    async def _after_reply(self, done: "_Done", reply: Reply, body: bytes, facts: ReplyFacts,
                           overhead_ms: float) -> None:
        """The upstream call completed: log it, reset the loop guard, keep the reply for retries."""
        gw = self.gw
        gw.metrics.requests.labels(done.route.model_name, "200").inc()
        gw.metrics.overhead.observe(overhead_ms)
        offset = None
        if facts.prompt_tokens is not None:
            gw.metrics.calibrate(done.route.model_name, done.plan.tokens_out, facts.prompt_tokens)
            offset = measured_offset(done.turn, done.plan.tokens_out, facts.prompt_tokens)
        if done.guard_set or offset is not None or gw.journal.enabled(done.caller.profile):
            try:
                async with gw.sessions.lock(done.caller.tenant, done.session_id):
                    state = await gw.load_session(done.caller.tenant, done.session_id)
                    state.has_attempted_reactive_compact = False  # a complete reply: compaction may run again
                    if offset is not None:
                        state.count_offset = offset
                        state.count_offset_key = done.offset_key
                    try:
                        await gw.journal.log_reply(state, reply.status, facts.prompt_tokens, facts.tool_calls)
                    finally:
                        await gw.sessions.save(state)
            except ApiError as e:  # the reply exists and the turn is logged: answer it rather than lose it
                log.error("session %s: the reply could not be logged: %s", done.session_id, e.message)
        if done.idempotency is not None:
            key, digest = done.idempotency
            await gw.idempotency.put(done.caller.tenant, key, StoredReply(
                digest, reply.status, reply.content_type, body, dict(done.headers), time.time()))


async def _uncancellable(work: Coroutine[Any, Any, None]) -> None:
    """Finish the bookkeeping of a completed upstream call even when the client leaves
    (an SDK closes the connection at `data: [DONE]`): the log and the stored reply must
    not depend on when the client hangs up."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


@dataclass
class _Done:
    """What the end of a turn needs to know about it."""
    caller: Caller
    session_id: str
    route: Route
    turn: Turn
    offset_key: str
    """What a count offset measured on this reply holds for (`count_offset_key`)."""
    plan: Plan
    guard_set: bool
    idempotency: tuple[str, str] | None
    headers: dict[str, str]
