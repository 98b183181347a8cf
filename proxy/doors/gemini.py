"""POST /v1beta/models/{model}:generateContent, :streamGenerateContent and :countTokens: the
Gemini door.

Gemini CLI and the Google Gen AI SDKs speak this API. The door reads the body into the
neutral model (`gemini_model`), lets the turn engine count, compact and forward it, renders
the forwarded body back in Gemini's shape (`gemini_render`), sends it natively to a `gemini/`
route (`upstream/gemini.py`), or as chat completions to any other (`gemini_chat`: directly or
through litellm), and answers in Gemini's shape, whole or streamed (`alt=sse`: SSE; else one
JSON array written as it comes). The key comes as
`x-goog-api-key` or `?key=` and selects the tenant as a bearer key does; every error leaves
in Google's shape.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import orjson
from aiohttp import web

from ..engine.memory_turn import scope_of
from ..engine.prepared import TurnInput
from ..engine.turn import TurnEngine
from ..engine.wire import ReplyFacts
from ..errors import ErrorKind, GatewayError
from ..gateway import Gateway
from ..tenancy import Caller, named_session, resolve_caller, resolve_session
from ..upstream.forwarders import Reply
from ..upstream.gemini import send_native
from ..upstream.routing import Route
from .caps import check_caps
from .gemini_expand import GeminiExpansion
from .gemini_chat import (Frames, chat_fields, chat_json, chat_messages, chat_tools, gemini_reply, gemini_stream,
                          reframed)
from .gemini_model import (ReadContents, conversation_of, count_bound, counted_body, known_turns, read_contents,
                           validate_request)
from .gemini_render import render
from .nesting import shallow
from .gemini_replies import GeminiStream, error_body, facts_of, google_response, reply_facts, upstream_error
from .respond import DoorRequest, Handler, add_door_route, answer, shaped_errors
from .validation import MAX_NESTING, read_resent_body

log = logging.getLogger("ctxgate.doors")
PATHS = ("/v1beta/models/{target}", "/v1/models/{target}")
"""Gemini CLI asks v1beta; the Google Gen AI SDKs v1 unless told otherwise: the same API."""
METHODS = ("generateContent", "streamGenerateContent", "countTokens")


class GeminiWire(GeminiExpansion):
    name = "gemini"

    def __init__(self, gw: Gateway, body: dict[str, Any], read: ReadContents, model: str,
                 sse: bool, raw: bytes | None = None, tools: list[dict[str, Any]] | None = None) -> None:
        self._gw = gw
        self._body = body
        self._raw = raw
        """The client's request bytes: what a native route is sent when nothing changed."""
        self._read = read
        self._tools = tools
        """The body's declarations as chat tools, made already (None: not yet)."""
        self._model = model
        self._sse = sse
        self._frames = Frames(sse)
        self._facts: tuple[bytes, ReplyFacts] | None = None
        """The reply rendered from a chat completion and what it says, read as it was rendered."""

    def payload(self, messages: list[dict[str, Any]], route: Route) -> dict[str, Any]:
        if messages is self._read.messages:
            return self._body
        system, contents = render(self._body, messages, self._read.contents)
        payload = {k: v for k, v in self._body.items() if k not in ("systemInstruction", "contents")}
        if system is not None:
            payload["systemInstruction"] = system
        payload["contents"] = contents
        return payload

    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None) -> Reply:
        if route.provider == "gemini":
            raw = self._raw if payload is self._body else None
            reply = await send_native(self._gw.direct, route, payload, raw, stream=stream, api_key=api_key)
            if reply.chunks is not None and not self._sse:
                self._frames = Frames(self._sse)
                reply.chunks = reframed(reply.chunks, self._frames)
                reply.content_type = "application/json"
            return reply
        tools = self._tools if payload is self._body else None
        chat = {**route.call_params, **chat_fields(payload, route.upstream_model, stream, tools)}
        direct = route.direct and not route.demo
        # The client's body unchanged: its conversation was read already, and its JSON for a
        # chat route is made for the new messages only.
        made = chat_json(chat, self._read) if direct and payload is self._body else None
        if made is None:
            read = self._read.messages if payload is self._body else conversation_of(payload)
            chat["messages"] = chat_messages(read)
        if direct:
            reply = await self._gw.direct.send(route, chat, stream=stream, api_key=api_key, raw=made)
        else:
            reply = await self._gw.forwarder_for(route).send(route, chat, stream=stream, api_key=api_key)
        if reply.chunks is None:
            rendered = gemini_reply(reply.body or b"", self._model)
            if rendered is not None:
                reply.body = orjson.dumps(rendered)
                self._facts = (reply.body, facts_of(rendered))
            reply.content_type = "application/json"
            return reply
        self._frames = Frames(self._sse)  # an expansion's follow-up is a stream of its own, sent instead
        reply.chunks = gemini_stream(reply.chunks, self._frames, self._model, upstream_error)
        reply.content_type = "text/event-stream" if self._frames.sse else "application/json"
        return reply

    def reply_facts(self, body: bytes) -> ReplyFacts:
        if self._facts is not None and body is self._facts[0]:
            return self._facts[1]
        return reply_facts(body)

    def stream_watch(self, keep_all: bool) -> GeminiStream:
        return GeminiStream(keep_all)

    def error_event(self, error: GatewayError) -> bytes:
        return self._frames.error(error_body(error))

    async def upstream_count(self, route: Route, messages: list[dict[str, Any]], api_key: str | None) -> int | None:
        return None  # the local tokenizer, calibrated, counts these routes

    async def settled(self, tenant: str, facts: ReplyFacts) -> None:
        return None


def google_errors(handler: Handler) -> Handler:
    """Every failure of this door in Google's shape."""
    return shaped_errors(handler, google_response)


def google_key(http: web.Request) -> str | None:
    """Google's key (`x-goog-api-key`, or `?key=`), read as the bearer key every door reads the
    tenant from, unless the request carries one of those (nothing later reads the key but from
    the caller: neither the request nor its headers are copied)."""
    if "Authorization" in http.headers or "x-api-key" in http.headers:
        return None
    return http.headers.get("x-goog-api-key") or http.query.get("key") or None


class GeminiDoor:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.engine = TurnEngine(gw)

    async def __call__(self, http: web.Request) -> web.StreamResponse:
        model, _, method = http.match_info["target"].rpartition(":")
        if not model or method not in METHODS:
            raise GatewayError(ErrorKind.NOT_FOUND, f"ctxgate's Gemini door serves POST /v1beta/models/"
                               f"{{model}}:{{{','.join(METHODS)}}}, not {http.path}", code="not_found")
        started = time.perf_counter()
        caller = resolve_caller(self.gw.config, http.headers, google_key(http))  # who asks first: a 401 before any 400
        key = (caller.tenant, "gemini", http.headers.get("X-Ctx-Session", ""))
        sent, resent = await read_resent_body(http, self.gw.json_parser, self.gw.resent, key,
                                              caller.tenant_config.max_body_bytes, "contents")
        body = counted_body(sent) if method == "countTokens" else sent
        system = body.get("systemInstruction")
        system_parts = system.get("parts") if isinstance(system, dict) else None
        raw = await http.read()
        check_caps(caller.tenant_config, body.get("contents"), "contents", len(raw), parts_key="parts",
                   extra_parts=len(system_parts) if isinstance(system_parts, list) else 0)
        # A body that resends the last one's bytes costs what its tail does (`ResentBodies`).
        fresh = resent.parsed_bytes if resent is not None else len(raw)

        def keep() -> None:  # once checked, for the next body (a countTokens body's turns may be nested)
            if body is sent:
                self.gw.resent.keep(key, raw, body, "contents", resent)

        listed = body.get("contents")
        route, read, session_id = await self.gw.heavy.run(
            caller.tenant, caller.tenant_config.heavy_concurrency, fresh,
            lambda: self._read(caller, http.headers, body, model, not shallow(raw, MAX_NESTING)),
            items=len(listed) if isinstance(listed, list) else None)
        messages = read.messages
        memory_on = self.gw.memory is not None and self.gw.memory.enabled(caller.profile)
        # The workspace root a steady turn's scope names was found in its first turns, last turn.
        scope = scope_of(http.headers, None, messages, read.workspace_root) if memory_on else None
        tools = read.tools
        turn = TurnInput(messages=messages, tools=tools or None,
                         stream=method == "streamGenerateContent",
                         memory_scope=scope,
                         body_bytes=len(raw), door_state=read,
                         count_bound=count_bound(raw, body) if not read.known else None,
                         fresh_bytes=fresh if read.known else None, keep=keep)
        wire = GeminiWire(self.gw, body, read, model, http.query.get("alt") == "sse", raw, tools)
        if method == "countTokens":
            return await self._count(DoorRequest(http, caller, route, session_id, turn, body, started), wire)
        return await answer(self.engine, DoorRequest(http, caller, route, session_id, turn, body, started), wire)

    def _read(self, caller: Caller, headers: Mapping[str, str], body: dict[str, Any], model: str,
              nested: bool) -> tuple[Route, ReadContents, str]:
        """The request checked (`nested`: its new turns' nesting too), read into the neutral model
        and placed: its route, conversation and session. In a thread when large (`HeavyWork`)."""
        named = named_session(headers)
        # The session's last request as this door read it: a steady turn checks and reads only what is new.
        last = self.gw.histories.door_state(caller.tenant, named) if named else None
        last = last if isinstance(last, ReadContents) else None
        known = known_turns(last, body.get("contents"))
        validate_request(body, known, last.fields if last is not None else None, nested)
        route = self.gw.router.resolve(model)
        read = read_contents(body, last, known)
        # Declarations resent as they were (the same objects, `ResentBodies`) were made chat tools last turn.
        made = last.tools if last is not None and "tools" in body and last.fields.get("tools") is body["tools"] \
            else None
        read.tools = made if made is not None else chat_tools(body.get("tools"))
        self.engine.refuse_hopeless(caller, route, read.messages)
        return route, read, resolve_session(caller.tenant, headers, read.messages)

    async def _count(self, request: DoorRequest, wire: GeminiWire) -> web.Response:
        """What the upstream would be sent now, after the stored compactions, the levels that
        need no model call and the memory block; no state change."""
        headers = {"X-Ctx-Session": request.session_id, "X-Ctx-Count": "after-compaction"}
        tokens = await self.engine.preview(request.caller, request.route, request.session_id, request.turn, wire,
                                           headers)
        return web.Response(body=orjson.dumps({"totalTokens": tokens}), content_type="application/json",
                            headers=headers)


def add_routes(app: web.Application, gw: Gateway) -> None:
    handler = google_errors(GeminiDoor(gw).__call__)
    for path in PATHS:
        add_door_route(app, "POST", path, handler)
