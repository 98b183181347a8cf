"""Anthropic's context editing on the Messages door, for any route (docs/native-context.md).

Where the route's vendor applies `context_management` itself (`context_settings`) the body
goes through untouched. Elsewhere ctxgate checks the edits (an unknown one is a 400 naming
it, before anything is forwarded), applies `clear_thinking_20251015` and
`clear_tool_uses_20250919` to the request's messages (`pipeline/context_edits.py`), takes the
field out of the forwarded body, and reports what it did in the reply's
`context_management.applied_edits`, whole or streamed (in `message_delta`, as Anthropic).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

import orjson
from aiohttp import web

from ctxgate.pipeline.context_edits import (CLEAR_THINKING, CLEAR_TOOL_USES, COMPACT, COMPACT_DEFAULT_TRIGGER,
                                            Applied, EditError, checked_edits, clear_thinking, clear_tool_uses)
from ..context_settings import mode_for, vendor_applies
from ..engine import client_compaction
from ..engine.client_compaction import keep
from ..engine.compaction import fingerprints_of
from ..errors import ErrorKind, GatewayError
from ..gateway import Gateway
from ..tenancy import Caller
from ..upstream.forwarders import Reply
from ..upstream.routing import Route
from .messages_compaction import BlockInjection, compaction_block, paused, paused_events, summary_of
from .messages_model import Conversation, conversation_of, render
from .respond import DoorRequest
from .sse import rewrite_events, with_data

FIELD = "context_management"


@dataclass
class Edited:
    """A Messages request whose context edits ctxgate applied."""
    body: dict[str, Any]
    """The body to forward: the edited messages, without `context_management`."""
    applied: list[Applied]
    edits: list[dict[str, Any]]
    tokens: int = 0
    """The request's tokens after the edits, as ctxgate counts them."""
    asked: bool = True
    """The client asked for context management (else only a compaction block was expanded): the reply reports it."""
    injection: BlockInjection | None = None
    """A compaction ran for `compact_20260112`: its block goes first in the reply."""

    @property
    def compact_trigger(self) -> tuple[dict[str, Any], int] | None:
        """The `compact_20260112` edit and its trigger, when the request is past it."""
        for edit in self.edits:
            if edit["type"] == COMPACT:
                trigger = (edit.get("trigger") or {}).get("value", COMPACT_DEFAULT_TRIGGER)
                return (edit, trigger) if self.tokens > trigger else None
        return None

    def report(self) -> dict[str, Any]:
        return {"applied_edits": [a.to_dict() for a in self.applied]}

    def counted(self, input_tokens: int) -> dict[str, Any]:
        """count_tokens' `context_management`: the count before the edits, in the units of
        `input_tokens` (the count after them), what they cleared added back."""
        return {"original_input_tokens": input_tokens + sum(a.cleared_input_tokens for a in self.applied)}

    def reply(self, reply: Reply) -> Reply:
        if self.injection is not None:
            reply = self.injection.reply(reply)
        if not self.asked:
            return reply
        if reply.chunks is not None:
            return replace(reply, chunks=self._stream(reply.chunks))
        try:
            data = orjson.loads(reply.body or b"")
        except orjson.JSONDecodeError:
            return reply
        if not isinstance(data, dict) or data.get("type") != "message":
            return reply
        return replace(reply, body=orjson.dumps({**data, FIELD: self.report()}))

    def _stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`applied_edits` in the `message_delta` event."""
        def rewrite(event: bytes, found: dict[str, Any]) -> bytes:
            if found.get("type") != "message_delta":
                return event + b"\n\n"
            return with_data(event, {**found, FIELD: self.report()})

        return rewrite_events(chunks, rewrite)


def emulated(gw: Gateway, caller: Caller, route: Route) -> bool:
    mode = mode_for(gw.config.ctxgate.native_context, caller.tenant_config.native_context, route.model_name)
    return not vendor_applies(mode, "anthropic_edits", route.provider, route.api_base)


def edited(gw: Gateway, caller: Caller, route: Route, body: dict[str, Any], changed: bool) -> Edited | None:
    """The request with its context edits applied by ctxgate; None when it asks for none, or
    the route's vendor applies them, and `changed` (a compaction block expanded) is False."""
    if FIELD not in body or not emulated(gw, caller, route):
        return Edited(body, [], [], asked=False) if changed else None
    try:
        edits = checked_edits(body[FIELD])
    except EditError as e:
        raise GatewayError(ErrorKind.INVALID_REQUEST, str(e), param=e.param, code="invalid_request") from None
    counter = gw.tokenizers.for_model(route.model_name, route.upstream_model)
    messages = body["messages"]
    neutral = conversation_of(body).neutral  # counted by fingerprint: the counter caches an earlier turn's
    tokens = counter.count_messages(neutral, fingerprints_of(neutral)) + counter.count_tools(body.get("tools"))
    applied: list[Applied] = []
    for edit in edits:
        done: Applied | None = None
        if edit["type"] == CLEAR_THINKING:
            messages, done = clear_thinking(messages, edit, counter.count)
        elif edit["type"] == CLEAR_TOOL_USES:
            messages, done = clear_tool_uses(messages, edit, tokens, counter.count)
        if done is not None:
            applied.append(done)
            tokens -= done.cleared_input_tokens
    forwarded = {k: v for k, v in body.items() if k != FIELD}
    forwarded["messages"] = messages
    return Edited(forwarded, applied, edits, tokens)


async def compact_for(gw: Gateway, request: DoorRequest, conversation: Conversation, edits: Edited,
                      edit: dict[str, Any], trigger: int) -> web.Response | None:
    """Compact the request for its `compact_20260112` edit: the block is put first in the
    forwarded turn's reply (`edits.injection`), or, with `pause_after_compaction`, is the reply."""
    turn = request.turn
    done = await client_compaction.compact(gw, request.caller, request.route, request.session_id, turn.messages,
                                           turn.tools, trigger, edit.get("instructions"))
    _, turns = render(conversation, done.messages)
    token = await keep(gw, request.caller, request.session_id, turns)
    block = compaction_block(summary_of(done, turn.messages), token)
    if edit.get("pause_after_compaction"):
        message = paused(conversation.body["model"], block, done, edits.report() if edits.asked else None)
        headers = {"X-Ctx-Session": request.session_id, "X-Ctx-Levels": ",".join(done.levels) or "none"}
        if turn.stream:
            return web.Response(body=paused_events(message), content_type="text/event-stream", headers=headers)
        return web.Response(body=orjson.dumps(message), content_type="application/json", headers=headers)
    edits.injection = BlockInjection(block, done)
    request.turn = replace(turn, messages=done.messages, known=None, door_state=None, count_bound=None)
    return None
