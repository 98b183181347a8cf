"""The OpenAI Responses door: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`,
`POST /v1/responses/input_tokens`.

A request is expanded to its whole conversation first (`previous_response_id` resolved
from what ctxgate returned before, see `response_store`), converted to the neutral model
(`responses_model`), and run through the one turn engine; the forwarded body carries the
whole (compacted) conversation and no `previous_response_id`, so the upstream need not
store anything. Errors leave in OpenAI's error shape, which is also this API's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Mapping

import orjson
from aiohttp import web

from ctxgate.pipeline.tokens import TOKENS_PER_MESSAGE, TOKENS_PER_TOOL, json_bound

from ..engine import client_compaction
from ..engine.compaction import fingerprints_of
from ..engine.memory_turn import scope_of
from ..engine.prepared import TurnInput
from ..engine.turn import TurnEngine
from ..engine.wire import ReplyFacts
from ..errors import ErrorKind, GatewayError
from ..gateway import Gateway
from ..tenancy import Caller, named_session, resolve_caller, resolve_session
from ..upstream.forwarders import Reply
from ..upstream.responses import ResponsesForwarder
from ..upstream.routing import Route
from .respond import DoorRequest, add_door_route, answer
from .responses_compaction import (FIELD, Injection, compacted_response, emulated, expanded, response_events,
                                   sealed_item, threshold_of, trigger_response, triggered, user_items)
from .responses_expand import ResponsesExpansion
from .response_store import ResponseStore, StoredResponse, open_response_store
from .responses_model import (Converted, checked_items, convert, input_items, to_request,
                              validate_responses_request)
from .caps import check_caps
from .validation import read_resent_body

_FINAL_EVENTS = ("response.completed", "response.failed", "response.incomplete")
_CHAIN_FIELDS = ("input", "instructions", "previous_response_id")
"""What the door rewrites: the forwarded body carries the whole conversation instead."""


def response_facts(response: Any) -> ReplyFacts:
    """Usage and function calls of a response object, and the object itself."""
    if not isinstance(response, dict):
        return ReplyFacts()
    usage = response.get("usage")
    tokens = usage.get("input_tokens") if isinstance(usage, dict) else None
    calls = [{"id": item.get("call_id"), "type": "function",
              "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
             for item in response.get("output") or [] if isinstance(item, dict) and item.get("type") == "function_call"]
    return ReplyFacts(tokens if isinstance(tokens, int) else None, calls, response)


class ResponsesStream:
    """Watches a Responses SSE stream go by; the final event's response object is the reply.
    Events may arrive split across network chunks: the unfinished one waits for the next."""

    def __init__(self, keep_all: bool) -> None:
        self._partial = b""
        self._all: bytearray | None = bytearray() if keep_all else None
        self._final: dict[str, Any] | None = None
        self._failed = False

    @property
    def complete(self) -> bool:
        return self._final is not None

    @property
    def failed(self) -> bool:
        return self._failed or (self._final is not None and self._final.get("status") == "failed")

    def feed(self, data: bytes) -> None:
        if self._all is not None:
            self._all += data
        events = (self._partial + data).replace(b"\r\n", b"\n").split(b"\n\n")
        self._partial = events.pop()
        for event in events:
            if event.startswith(b"event: error"):
                self._failed = True
            if self._final is None and any(kind.encode() in event for kind in _FINAL_EVENTS):
                self._final = _final_response(event)

    def body(self) -> bytes:
        return bytes(self._all) if self._all is not None else b""

    def facts(self) -> ReplyFacts:
        return response_facts(self._final)


def _final_response(event: bytes) -> dict[str, Any] | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                data = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return None
            if isinstance(data, dict) and data.get("type") in _FINAL_EVENTS and isinstance(data.get("response"), dict):
                return data["response"]
    return None


class ResponsesWire(ResponsesExpansion):
    name = "responses"

    def __init__(self, forwarder: ResponsesForwarder, store: ResponseStore, body: dict[str, Any],
                 own_items: list[dict[str, Any]], session_id: str, conversation: list[dict[str, Any]] | None = None,
                 raw: bytes | None = None, injection: Injection | None = None) -> None:
        self._forwarder = forwarder
        self._store = store
        self._session_id = session_id
        self._original = body
        self._body = {k: v for k, v in body.items() if k not in _CHAIN_FIELDS}
        self._previous: str | None = body.get("previous_response_id")
        self._store_false = body.get("store") is False
        self._own_items = own_items
        self._conversation = conversation
        """The request's own conversation (neutral model): forwarded unchanged, the client's bytes go."""
        self._raw = raw
        self._injection = injection
        """A compaction the client asked for: its item goes first in the reply."""

    def payload(self, messages: list[dict[str, Any]], route: Route) -> dict[str, Any]:
        if (messages is self._conversation and self._previous is None and not route.call_params
                and route.upstream_model == self._original.get("model")):
            return self._original  # nothing compacted, added or chained: `send` forwards the client's own bytes
        instructions, items = to_request(messages)
        payload = {**route.call_params, **self._body, "model": route.upstream_model, "input": items}
        if instructions is not None:
            payload["instructions"] = instructions
        return payload

    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None) -> Reply:
        raw = self._raw if payload is self._original else None
        reply = await self._forwarder.send(route, payload, stream=stream, api_key=api_key, raw=raw)
        return self._injection.reply(reply) if self._injection is not None else reply

    def reply_facts(self, body: bytes) -> ReplyFacts:
        try:
            data = orjson.loads(body or b"")
        except orjson.JSONDecodeError:
            return ReplyFacts(malformed="not JSON")
        if not isinstance(data, dict) or not isinstance(data.get("output"), list):
            return ReplyFacts(malformed="JSON without an `output` list")
        return response_facts(data)

    def stream_watch(self, keep_all: bool) -> ResponsesStream:
        return ResponsesStream(keep_all)

    def error_event(self, error: GatewayError) -> bytes:
        event = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"

    async def upstream_count(self, route: Route, messages: list[dict[str, Any]], api_key: str | None) -> int | None:
        return None  # the local tokenizer counts these routes

    async def settled(self, tenant: str, facts: ReplyFacts) -> None:
        """Keep the reply so a later `previous_response_id` resolves to it (not one made with
        `store: false`: see response_store). Its id is the upstream's; its chain link the client's."""
        response = facts.response
        if self._store_false or response is None or not isinstance(response.get("id"), str) \
                or not isinstance(response.get("output"), list):
            return
        kept = {**response, "previous_response_id": self._previous}
        await self._store.put(tenant, StoredResponse(response["id"], self._previous, self._own_items,
                                                     response["output"], kept, time.time(), self._session_id))


class ResponsesDoor:
    def __init__(self, gw: Gateway, store: ResponseStore) -> None:
        self.gw = gw
        self.store = store
        self.engine = TurnEngine(gw)
        self.forwarder = ResponsesForwarder(gw.direct)

    async def create(self, http: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        caller, body, route, turn, session_id, asked = await self._read(http, input_required=True)
        request = DoorRequest(http, caller, route, session_id, turn, body, started)
        if not asked.changed:
            wire = ResponsesWire(self.forwarder, self.store, body, input_items(body), session_id, turn.messages,
                                 await http.read())
            return await answer(self.engine, request, wire)
        forwarded = {k: v for k, v in body.items() if k != FIELD}
        injection = None
        if asked.trigger or asked.past_threshold(self.gw, route, turn):
            done = await client_compaction.compact(self.gw, caller, route, session_id, turn.messages, turn.tools,
                                                   None if asked.trigger else asked.threshold)
            item = await sealed_item(self.gw, caller, session_id, to_request(done.messages)[1])
            if asked.trigger:  # answered by ctxgate alone: the compaction is the whole reply
                turn.kept()
                reply = trigger_response(body["model"], item, done.usage)
                headers = {"X-Ctx-Session": session_id, "X-Ctx-Levels": ",".join(done.levels) or "none"}
                if turn.stream:
                    return web.Response(body=response_events(reply), content_type="text/event-stream",
                                        headers=headers)
                return web.json_response(reply, headers=headers, dumps=lambda v: orjson.dumps(v).decode())
            injection = Injection(item, done)
            request.turn = replace(turn, messages=done.messages, known=None, door_state=None, count_bound=None)
        wire = ResponsesWire(self.forwarder, self.store, forwarded, input_items(body), session_id,
                             injection=injection)
        return await answer(self.engine, request, wire)

    async def compact(self, http: web.Request) -> web.Response:
        """`POST /v1/responses/compact`: the conversation compacted now, answered with the user
        messages and one compaction item, whatever the route (no model call but the summary's)."""
        caller, body, route, turn, session_id, _ = await self._read(http, input_required=False, compacting=True)
        done = await client_compaction.compact(self.gw, caller, route, session_id, turn.messages, turn.tools, None)
        turn.kept()
        item = await sealed_item(self.gw, caller, session_id, to_request(done.messages)[1])
        reply = compacted_response(body["model"], user_items(input_items(body)), item, done.usage)
        return web.Response(body=orjson.dumps(reply), content_type="application/json",
                            headers={"X-Ctx-Session": session_id, "X-Ctx-Levels": ",".join(done.levels) or "none"})

    async def input_tokens(self, http: web.Request) -> web.Response:
        """What the upstream would be sent now: after the stored compactions, the levels that
        need no model call, and the memory block."""
        caller, body, route, turn, session_id, _ = await self._read(http, input_required=False)
        headers = {"X-Ctx-Session": session_id, "X-Ctx-Count": "after-compaction"}
        wire = ResponsesWire(self.forwarder, self.store, body, input_items(body), session_id)
        tokens = await self.engine.preview(caller, route, session_id, turn, wire, headers)
        return web.Response(body=orjson.dumps({"object": "response.input_tokens", "input_tokens": tokens}),
                            content_type="application/json", headers=headers)

    async def _read(self, http: web.Request, *, input_required: bool, compacting: bool = False
                    ) -> tuple[Caller, dict[str, Any], Route, TurnInput, str, Asked]:
        caller = resolve_caller(self.gw.config, http.headers)  # who asks first: a 401 before any 400
        key = (caller.tenant, "responses", http.headers.get("X-Ctx-Session", ""))
        body, resent = await read_resent_body(http, self.gw.json_parser, self.gw.resent, key,
                                              caller.tenant_config.max_body_bytes, "input")
        raw = await http.read()
        check_caps(caller.tenant_config, body.get("input"), "input", len(raw))
        # A body that resends the last one's bytes costs what its tail does (`ResentBodies`).
        size = resent.parsed_bytes if resent is not None else len(raw)
        heavy, slots = self.gw.heavy, caller.tenant_config.heavy_concurrency
        named = named_session(http.headers, body.get("prompt_cache_key"))
        # The session's last request as this door read it: a steady turn checks and converts only what is new.
        last = self.gw.histories.door_state(caller.tenant, named) if named else None
        last = last if isinstance(last, Converted) else None
        previous = body.get("previous_response_id")

        def validated() -> int:
            known = checked_items(last, body.get("instructions"), body.get("input")) if not previous else 0
            validate_responses_request(body, input_required=input_required, start=known)
            return known
        listed = body.get("input")
        # A large body of few items is checked on the loop: its work costs less than a thread hop (`HeavyWork.heavy`).
        known = await heavy.run(caller.tenant, slots, size, validated,
                                items=len(listed) if isinstance(listed, list) else None)
        route = self.gw.router.resolve(body["model"])
        history, chained_session = await self.store.conversation(caller.tenant, previous) if previous else ([], None)
        asked = Asked(emulated(self.gw, caller, route) or compacting)
        items = history + input_items(body)
        if asked.emulating:
            asked.threshold, asked.changed = threshold_of(body), FIELD in body
            items, asked.trigger = triggered(items)
        found = await expanded(self.gw, caller, items, asked.emulating)
        asked.changed = asked.changed or asked.trigger or found is not items
        if found is not items:
            last = None  # the conversation is not the request's input as sent
        converted = await heavy.run(caller.tenant, slots, size, lambda: convert(body.get("instructions"), found, last),
                                    items=len(found))
        if not previous and not asked.changed:  # every item is the request's own input, checked above
            converted = replace(converted, checked=len(converted.items))
        messages = converted.messages
        if not messages:
            raise GatewayError(ErrorKind.INVALID_REQUEST,
                               "the conversation is empty: give `input` or `instructions`", param="input",
                           code="invalid_request")
        session_id = await heavy.run(caller.tenant, slots, size,
                                     lambda: self._placed(caller, http.headers, route, body, messages),
                                     items=len(messages))
        if chained_session is not None and session_id.startswith("fp-") and "X-Ctx-Session" not in http.headers:
            # A fingerprint names the conversation by its start, and instructions are not
            # inherited along a chain: the chain's own session is the better name.
            session_id = chained_session
        memory_on = self.gw.memory is not None and self.gw.memory.enabled(caller.profile)
        tools = body.get("tools")
        # A body that holds the whole conversation bounds its count (`tokens.json_bound`), with a
        # margin for what an item's message or a flat tool counts beyond its own JSON. Only a new
        # conversation's count uses it: a steady turn's scan of its bytes (a millisecond per
        # 800 KB) is spared.
        bound = json_bound(raw) + TOKENS_PER_MESSAGE * len(found) + TOKENS_PER_TOOL * (
            len(tools) if isinstance(tools, list) else 0) if not previous and found is items and not known else None
        turn = TurnInput(messages=messages, tools=tools, stream=bool(body.get("stream")),
                         memory_scope=scope_of(http.headers, body.get("user"), messages) if memory_on else None,
                         door_state=converted, body_bytes=len(raw), fresh_bytes=size if resent is not None else None,
                         count_bound=bound,
                         # checked: the next body parses only its tail
                         keep=lambda: self.gw.resent.keep(key, raw, body, "input", resent))
        return caller, body, route, turn, session_id, asked

    def _placed(self, caller: Caller, headers: Mapping[str, str], route: Route, body: dict[str, Any],
                messages: list[dict[str, Any]]) -> str:
        """The conversation's session, once it is known not to be hopeless. In a thread when large."""
        self.engine.refuse_hopeless(caller, route, messages)
        return resolve_session(caller.tenant, headers, messages, body.get("prompt_cache_key"))

    async def retrieve(self, http: web.Request) -> web.Response:
        caller = resolve_caller(self.gw.config, http.headers)
        response_id = http.match_info["response_id"]
        stored = await self.store.get(caller.tenant, response_id)
        if stored is None:
            raise _unknown(response_id)
        return web.Response(body=orjson.dumps(stored.response), content_type="application/json")

    async def delete(self, http: web.Request) -> web.Response:
        caller = resolve_caller(self.gw.config, http.headers)
        response_id = http.match_info["response_id"]
        if not await self.store.delete(caller.tenant, response_id):
            raise _unknown(response_id)
        return web.Response(body=orjson.dumps({"id": response_id, "object": "response", "deleted": True}),
                            content_type="application/json")


@dataclass
class Asked:
    """What the request asks of OpenAI's compaction, on a route where ctxgate applies it."""
    emulating: bool
    threshold: int | None = None
    trigger: bool = False
    changed: bool = False
    """The forwarded body differs from the client's: the field goes, or items were expanded or taken out."""

    def past_threshold(self, gw: Gateway, route: Route, turn: TurnInput) -> bool:
        if self.threshold is None:
            return False
        counter = gw.tokenizers.for_model(route.model_name, route.upstream_model)
        # By fingerprint: the counter's cache holds what an earlier turn of the session counted.
        tokens = counter.count_messages(turn.messages, fingerprints_of(turn.messages))
        return tokens + counter.count_tools(turn.tools) > self.threshold


def _unknown(response_id: str) -> GatewayError:
    return GatewayError(ErrorKind.NOT_FOUND,
                        f"No response found with id '{response_id}'.", param="response_id", code="not_found")


def add_routes(app: web.Application, gw: Gateway) -> ResponseStore:
    """The door's routes; returns its store (deleting a session's data reaches it)."""
    store = open_response_store(gw.config.ctxgate.state, gw.data_dir)
    door = ResponsesDoor(gw, store)
    for prefix in ("/v1", ""):
        add_door_route(app, "POST", f"{prefix}/responses", door.create)
        add_door_route(app, "POST", f"{prefix}/responses/input_tokens", door.input_tokens)
        add_door_route(app, "POST", f"{prefix}/responses/compact", door.compact)
        add_door_route(app, "GET", f"{prefix}/responses/{{response_id}}", door.retrieve)
        add_door_route(app, "DELETE", f"{prefix}/responses/{{response_id}}", door.delete)

    async def _close(app: web.Application) -> None:
        await store.close()

    app.on_cleanup.append(_close)
    return store
