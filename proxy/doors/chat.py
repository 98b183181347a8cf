"""POST /v1/chat/completions: the OpenAI door.

The chat-completions message list is the neutral conversation model itself, so parsing
is validation and rendering is putting the compacted list back in the body.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import orjson
from aiohttp import web

from ctxgate.pipeline.notes import strip_tag
from ctxgate.pipeline.tokens import holds_parts, json_bound
from ..engine.memory_turn import scope_of
from ..engine.history import KnownPrefix
from ..engine.prepared import TurnInput
from ..engine.turn import TurnEngine
from ..engine.wire import ReplyFacts
from ..errors import GatewayError
from ..gateway import Gateway
from ..tenancy import Caller, resolve_caller, resolve_session
from ..upstream.forwarders import Reply
from ..upstream.routing import Route
from .caps import check_caps
from .errors import openai_body
from .chat_expand import ChatExpansion
from .chat_replies import SseReply, reply_facts
from .respond import DoorRequest, answer
from .validation import read_resent_body, validate_chat_messages, validate_chat_request


class ChatWire(ChatExpansion):
    name = "chat"

    def __init__(self, gw: Gateway, body: dict[str, Any], raw: bytes) -> None:
        self._gw = gw
        self._body = body
        self._raw = raw

    def payload(self, messages: list[dict[str, Any]], route: Route) -> dict[str, Any]:
        if messages is self._body["messages"] and not route.call_params and route.upstream_model == self._body["model"]:
            return self._body  # nothing changed: `send` forwards the client's own bytes
        # ctxgate's own notes carry a field the upstream is not sent.
        return {**route.call_params, **self._body, "model": route.upstream_model,
                "messages": [strip_tag(m) for m in messages]}

    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None) -> Reply:
        if route.direct and not route.demo:
            raw = self._raw if payload is self._body else None
            return await self._gw.direct.send(route, payload, stream=stream, api_key=api_key, raw=raw)
        return await self._gw.forwarder_for(route).send(route, payload, stream=stream, api_key=api_key)

    def reply_facts(self, body: bytes) -> ReplyFacts:
        return reply_facts(body)

    def stream_watch(self, keep_all: bool) -> SseReply:
        return SseReply(keep_all=keep_all)

    def error_event(self, error: GatewayError) -> bytes:
        return b"data: " + orjson.dumps(openai_body(error)) + b"\n\n"

    async def upstream_count(self, route: Route, messages: list[dict[str, Any]], api_key: str | None) -> int | None:
        return None  # the local tokenizer counts these routes

    async def settled(self, tenant: str, facts: ReplyFacts) -> None:
        return None


class ChatDoor:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.engine = TurnEngine(gw)

    async def __call__(self, http: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        caller = resolve_caller(self.gw.config, http.headers)  # who asks first: a 401 before any 400
        key = (caller.tenant, "chat", http.headers.get("X-Ctx-Session", ""))
        body, resent = await read_resent_body(http, self.gw.json_parser, self.gw.resent, key,
                                              caller.tenant_config.max_body_bytes)
        raw = await http.read()
        check_caps(caller.tenant_config, body.get("messages"), "messages", len(raw))
        # A body that resends the last one's bytes costs what its tail does (`ResentBodies`).
        fresh = resent.parsed_bytes if resent is not None else len(raw)

        def keep() -> None:
            self.gw.resent.keep(key, raw, body, "messages", resent)

        listed = body.get("messages")
        route, session_id, known, bound = await self.gw.heavy.run(
            caller.tenant, caller.tenant_config.heavy_concurrency, fresh,
            lambda: self._read(caller, http.headers, body, raw),
            items=len(listed) if isinstance(listed, list) else None)
        messages = body["messages"]
        memory_on = self.gw.memory is not None and self.gw.memory.enabled(caller.profile)
        turn = TurnInput(messages=messages, tools=body.get("tools"), stream=bool(body.get("stream")),
                         memory_scope=scope_of(http.headers, body.get("user"), messages) if memory_on else None,
                         known=known, body_bytes=len(raw), count_bound=bound,
                         fresh_bytes=fresh if known.length else None, keep=keep)
        request = DoorRequest(http, caller, route, session_id, turn, body, started)
        return await answer(self.engine, request, ChatWire(self.gw, body, raw))

    def _read(self, caller: Caller, headers: Mapping[str, str], body: dict[str, Any], raw: bytes
              ) -> tuple[Route, str, KnownPrefix, int | None]:
        """The request checked and placed: its route, session, what of it the session knew, and
        its count's bound (only a new conversation is bounded). In a thread when large (`HeavyWork`)."""
        validate_chat_request(body)
        messages = body["messages"]
        route = self.gw.router.resolve(body["model"])
        self.engine.refuse_hopeless(caller, route, messages)
        session_id = resolve_session(caller.tenant, headers, messages, body.get("prompt_cache_key"))
        known = self.gw.histories.match(caller.tenant, session_id, messages)
        validate_chat_messages(messages, known.length)
        return route, session_id, known, json_bound(raw, holds_parts(messages)) if known.length == 0 else None
