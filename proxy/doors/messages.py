"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages door.

Claude Code and the Anthropic SDK speak this API. The door reads the body into the neutral
model (`messages_model.conversation_of`), lets the turn engine count, compact and forward it,
and renders every error, its own and the engine's, in Anthropic's shape.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import orjson
from aiohttp import web

from ..engine.memory_turn import scope_of
from ..engine.history import KnownPrefix
from ..engine.prepared import TurnInput
from ..engine.turn import TurnEngine
from ..engine.wire import ReplyFacts
from ..errors import ErrorKind, GatewayError
from ..gateway import Gateway
from ..tenancy import Caller, named_session, resolve_caller, resolve_session
from ..upstream.anthropic import MessagesCall, count_native, send_litellm, send_native
from ..upstream.forwarders import Reply
from ..upstream.routing import Route
from .caps import check_caps
from .errors import http_status
from .context_management import Edited, compact_for, edited, emulated
from .messages_compaction import expanded as expanded_blocks
from .messages_expand import MessagesExpansion
from .messages_model import Conversation, conversation_of, render, validate_messages, validate_messages_request
from .messages_read import ReadAt, ReadMessages, compacted, known_messages, read_messages
from .messages_replies import MessagesStream, error_body, error_event, reply_facts
from .respond import DoorRequest, Handler, add_door_route, answer, shaped_errors
from .validation import read_resent_body

log = logging.getLogger("ctxgate.doors")
COUNT_HEADER = "X-Ctx-Count"


class MessagesWire(MessagesExpansion):
    name = "messages"

    def __init__(self, gw: Gateway, conversation: Conversation, raw: bytes | None, http: web.Request,
                 counting: bool = False, edits: Edited | None = None) -> None:
        self._gw = gw
        self._conversation = conversation
        self._body = conversation.body
        self._raw = raw
        self._counting = counting
        self._edits = edits
        """Context edits ctxgate applied (context_management.py): the reply reports them."""
        """The client's request is a count_tokens one: its own bytes are what Anthropic counts."""
        self._version = http.headers.get("anthropic-version")
        self._beta = http.headers.get("anthropic-beta")
        # A client that signs in with a bearer token (Claude Code's OAuth login) and whose tenant
        # passes its key through must reach Anthropic the same way, not as an x-api-key.
        auth = http.headers.get("Authorization", "")
        self._bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else None

    def payload(self, messages: list[dict[str, Any]], route: Route) -> dict[str, Any]:
        system, turns = render(self._conversation, messages)
        if route.call_params or route.upstream_model != self._body["model"] or system != self._body.get("system") \
                or turns != self._body["messages"]:
            payload = {**route.call_params, **self._body, "model": route.upstream_model, "messages": turns}
            payload.pop("system", None)
            if system:
                payload["system"] = system
            return payload
        return self._body  # nothing changed: `send` forwards the client's own bytes

    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None) -> Reply:
        call = MessagesCall(payload, self._raw if payload is self._body else None, self._version, self._beta,
                            bearer=api_key is not None and api_key == self._bearer)
        if route.provider == "anthropic":
            reply = await send_native(self._gw.direct, route, call, stream=stream, api_key=api_key)
        elif route.demo:
            raise GatewayError(ErrorKind.INVALID_REQUEST,
                               f"{route.model_name} answers chat completions only", param="model")
        else:
            reply = await send_litellm(self._gw.direct, route, call, stream=stream, api_key=api_key)
        return self._edits.reply(reply) if self._edits is not None else reply

    async def upstream_count(self, route: Route, messages: list[dict[str, Any]], api_key: str | None) -> int | None:
        if route.provider != "anthropic":
            return None  # the calibrated estimate counts the litellm adapter's routes
        payload = self.payload(messages, route)
        raw = self._raw if self._counting and payload is self._body else None
        call = MessagesCall(payload, raw, self._version, self._beta,
                            bearer=api_key is not None and api_key == self._bearer)
        return await count_native(self._gw.direct, route, call, api_key)

    def reply_facts(self, body: bytes) -> ReplyFacts:
        return reply_facts(body)

    def stream_watch(self, keep_all: bool) -> MessagesStream:
        return MessagesStream(keep_all)

    def error_event(self, error: GatewayError) -> bytes:
        return error_event(error)

    async def settled(self, tenant: str, facts: ReplyFacts) -> None:
        return None


def anthropic_errors(handler: Handler) -> Handler:
    """Every failure of this door in Anthropic's shape."""
    return shaped_errors(handler, lambda error: web.Response(
        status=http_status(error), body=orjson.dumps(error_body(error)), content_type="application/json",
        headers=error.headers))


class MessagesDoor:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.engine = TurnEngine(gw)

    async def read(self, http: web.Request, *, counting: bool) -> tuple[DoorRequest, Conversation, Edited | None]:
        started = time.perf_counter()
        caller = resolve_caller(self.gw.config, http.headers)  # who asks first: a 401 before any 400
        key = (caller.tenant, "messages", http.headers.get("X-Ctx-Session", ""))
        body, resent = await read_resent_body(http, self.gw.json_parser, self.gw.resent, key,
                                              caller.tenant_config.max_body_bytes)
        system = body.get("system")
        raw = await http.read()
        check_caps(caller.tenant_config, body.get("messages"), "messages", len(raw),
                   extra_parts=len(system) if isinstance(system, list) else 0)
        # A body that resends the last one's bytes costs what its tail does (`ResentBodies`).
        fresh = resent.parsed_bytes if resent is not None else len(raw)
        heavy = self.gw.heavy
        slots = caller.tenant_config.heavy_concurrency
        # A breakpoint moved off the last turn's newest message makes the whole body parsed anew,
        # but the messages read are still only the new ones: a body of few messages stays inline.
        items = len(sent) if isinstance(sent := body.get("messages"), list) else None
        named = named_session(http.headers)
        # The session's last request as this door read it: a steady turn checks and reads only what is new.
        last = self.gw.histories.door_state(caller.tenant, named) if named else None
        last = last if isinstance(last, ReadMessages) else None

        def checked() -> tuple[int, bool]:
            validate_messages_request(body, counting=counting)
            known = known_messages(last, system, body["messages"])
            return known, compacted(body["messages"], last, known)

        known_at, blocks = await heavy.run(caller.tenant, slots, fresh, checked, items)
        route = self.gw.router.resolve(body["model"])
        found = await expanded_blocks(self.gw, caller, body["messages"], emulated(self.gw, caller, route)) \
            if blocks else body["messages"]

        def keep() -> None:  # once checked and forwarded (or counted), for the next body
            self.gw.resent.keep(key, raw, body, "messages", resent)

        conversation, edits, session_id, known, read = await heavy.run(
            caller.tenant, slots, fresh,
            lambda: self._placed(caller, http.headers, route, body, found, ReadAt(last, known_at, blocks)), items)
        messages = conversation.neutral
        memory_on = self.gw.memory is not None and self.gw.memory.enabled(caller.profile)
        user = (body.get("metadata") or {}).get("user_id")
        turn = TurnInput(messages=messages, tools=body.get("tools"), stream=bool(body.get("stream")),
                         memory_scope=scope_of(http.headers, user, messages) if memory_on else None,
                         known=known, body_bytes=len(raw), door_state=read,
                         fresh_bytes=fresh if known.length else None, keep=keep)
        return DoorRequest(http, caller, route, session_id, turn, body, started), conversation, edits

    def _placed(self, caller: Caller, headers: Mapping[str, str], route: Route, body: dict[str, Any],
                found: list[dict[str, Any]], at: ReadAt
                ) -> tuple[Conversation, Edited | None, str, KnownPrefix, ReadMessages]:
        """The request read into the neutral model (its context edits applied), checked, and
        placed in its session. In a thread when large (`HeavyWork`)."""
        changed = found is not body["messages"]
        edits = edited(self.gw, caller, route, {**body, "messages": found} if changed else body, changed=changed)
        if edits is None:
            conversation, read = read_messages(body, at)
        else:  # edited or expanded: other messages than the client's
            conversation = conversation_of(edits.body)
            read = ReadMessages(body.get("system"), list(body["messages"]), at.blocks)
        messages = conversation.neutral
        self.engine.refuse_hopeless(caller, route, messages)
        validate_messages(body["messages"], at.known)  # the client's: what was new in them is checked, as sent
        session_id = resolve_session(caller.tenant, headers, messages)
        return conversation, edits, session_id, self.gw.histories.match(caller.tenant, session_id, messages), read

    async def messages(self, http: web.Request) -> web.StreamResponse:
        request, conversation, edits = await self.read(http, counting=False)
        raw = await http.read() if edits is None else None  # read once already: aiohttp hands back the same bytes
        if edits is not None and (due := edits.compact_trigger) is not None:
            paused = await compact_for(self.gw, request, conversation, edits, *due)
            if paused is not None:
                request.turn.kept()
                return paused
        return await answer(self.engine, request, MessagesWire(self.gw, conversation, raw, http, edits=edits))

    async def count_tokens(self, http: web.Request) -> web.StreamResponse:
        """What the upstream would be sent for this conversation now, after compaction and the
        memory block: the client sizes its next turn by it. Counted by Anthropic's own
        count_tokens on an Anthropic route (no model call), else the calibrated estimate; no
        state change."""
        request, conversation, edits = await self.read(http, counting=True)
        headers = {"X-Ctx-Session": request.session_id, COUNT_HEADER: "after-compaction"}
        wire = MessagesWire(self.gw, conversation, await http.read() if edits is None else None, http, counting=True)
        tokens = await self.engine.preview(request.caller, request.route, request.session_id, request.turn, wire,
                                           headers)
        counted: dict[str, Any] = {"input_tokens": tokens}
        if edits is not None and edits.asked:  # as Anthropic answers a count with context_management
            counted["context_management"] = edits.counted(tokens)
        return web.Response(body=orjson.dumps(counted), content_type="application/json", headers=headers)


def add_routes(app: web.Application, gw: Gateway) -> None:
    door = MessagesDoor(gw)
    add_door_route(app, "POST", "/v1/messages", anthropic_errors(door.messages))
    add_door_route(app, "POST", "/v1/messages/count_tokens", anthropic_errors(door.count_tokens))
