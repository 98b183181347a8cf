"""The expansion tool the gateway answers itself (docs/expansion.md).

Once a session has been compacted, the forwarded request offers one more tool. This is the
door-independent half: the tool's definition, the per-turn limits, each answer read from the
content store, and the loop every door with tools runs around the upstream call (`expanded`).

A reply whose only tool calls are the gateway's own is not returned: each call is answered
from the content store, appended with its result after everything that was sent (so the
prefix the provider caches is unchanged), and the upstream is asked again, at most
`expand.max_per_turn` times, then once more with results that only say the limit is reached
(a reply that still asks is returned with its calls taken out). A reply that mixes our calls
with the agent's is returned with ours taken out: the agent's calls are never held back or
lost, and the model may ask again next turn. A streamed reply is held only until it shows
what it opens with: text, or the agent's call, flows from there as usual (our calls, if any
come later, are taken out). Each door's wire forms are `doors/*_expand.py`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Protocol, runtime_checkable

import orjson

from ctxgate.pipeline.config import ExpandConfig
from ctxgate.pipeline.depth import growth_per_turn
from ctxgate.pipeline.excerpt import excerpt
from ctxgate.pipeline.refs import REF_HEX, CutLog
from ctxgate.pipeline.tokens import TokenCounter
from ..upstream.errors import ContextTooLong, UpstreamError
from ..upstream.forwarders import Reply
from ..upstream.routing import Route
from .content_store import ContentStore
from .state import SessionState
from .turn_budget import Plan, Turn, budget_of

_REF = re.compile(r"^(?:ref )?(?:ctx:)?([0-9a-f]{%d})$" % REF_HEX)
CALL_TOKENS = 100
"""What one call and its result cost besides the result's text (the assistant turn, the wrapping)."""
MIN_RESULT_TOKENS = 64
"""Below this, no part of an original says anything: the model is told there is no room."""


def tool_definition(config: ExpandConfig) -> dict[str, Any]:
    """The tool in the neutral form each door renders: a name, a description, a JSON schema.
    Built from the config alone, so it is byte-identical on every turn of a session."""
    return {"name": config.tool_name, "description": config.description,
            "parameters": {"type": "object", "properties": {"ref": {
                "type": "string", "description": "The reference a compaction note names, e.g. ctx:7f3a91c2d4e5"}},
                "required": ["ref"]}}


def tool_tokens(config: ExpandConfig, counter: TokenCounter, tools: list[dict[str, Any]]) -> int:
    """What offering the tool adds to a request whose own tools are `tools`, as ctxgate counts a
    tools schema: counted in what is forwarded, as the provider counts it (its hundred-odd
    tokens were once left to the calibration, and at a small limit they are the safety margin)."""
    ours = {"type": "function", "function": tool_definition(config)}
    return counter.count_tools([*tools, ours]) - counter.count_tools(tools)


def without_exchanges(messages: list[dict[str, Any]], expanded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` without the expansion exchanges of earlier turns (`SessionState.expanded`),
    for a request that offers no tools, so not ours either: a call of a tool the request does
    not define is one a provider may refuse (Anthropic refuses tool_use blocks without tools)."""
    ours = {orjson.dumps(m) for entry in expanded for m in entry["messages"]}
    return [m for m in messages if orjson.dumps(m) not in ours] if ours else messages


def expansion_room(turn: Turn, state: SessionState, plan: Plan) -> int | None:
    """Tokens the turn's expansions may add: up to the
    compaction trigger less one turn of the session's growth, and at least half the room up
    to the trigger. A follow-up is never itself a request ctxgate would have compacted, and
    what the model asked for stays in the conversation on later turns
    (`SessionState.expanded`): results that filled the room up to the trigger would make the
    next turn a compaction point, a cache break paid for one expansion (measured on
    check_pipeline's run, where the model expands every reference it sees: a point at nearly
    every turn). None: the plan is not counted yet. The tool's own definition is in the plan's
    count (`tool_tokens`)."""
    if plan.tokens_out is None:
        return None
    room = int(turn.config.trigger_ratio * budget_of(state, turn)) - plan.tokens_out - turn.count_offset
    return int(max(room / 2, room - growth_per_turn(turn)))


@dataclass
class ToolCall:
    """One call of the expansion tool in a reply: its id and its raw arguments."""
    call_id: str
    arguments: str


@dataclass
class Expansion:
    """One turn's expansions: what was served, within the turn's limits."""
    config: ExpandConfig
    store: ContentStore
    tenant: str
    session_id: str
    counter: TokenCounter
    on_answer: Callable[[str, int], None] = lambda outcome, tokens: None
    """Told each answer's outcome (served, missing, repeated, invalid) and tokens: the metrics."""
    served: dict[str, int] = field(default_factory=dict)
    """Each reference given back this turn, with the tokens of its result (what the WAL logs)."""
    rounds: int = 0
    """Follow-up upstream calls made: at most `config.max_per_turn` that expand, then one whose
    results only say the limit is reached, so the model answers rather than the agent getting
    an empty reply."""
    exchange: list[dict[str, Any]] = field(default_factory=list)
    """What the follow-ups appended (the model's calls and their results), in the neutral
    model: kept with the session once the turn is answered, and put back in place on later
    turns (`SessionState.expanded`)."""
    room: int | None = None
    """Tokens the results may still add (`expansion_room`; None: only `config.result_tokens`
    bounds them). An expansion must not undo the compaction that made room; each result takes
    its share."""

    @property
    def tool_name(self) -> str:
        return self.config.tool_name

    def may_continue(self) -> bool:
        return self.rounds <= self.config.max_per_turn

    async def answer(self, call: ToolCall) -> str:
        """The tool result for one call: the original within the size cap and the room left
        (`excerpt`: what is left out named by new references), or one sentence saying why not.
        Never an error: the model reads it."""
        ref = _ref_of(call.arguments)
        if self.rounds >= self.config.max_per_turn:
            self.on_answer("limit", 0)
            return (f"No more expansions in this turn (at most {self.config.max_per_turn}). Answer with what you "
                    "have; a reference can be asked for again in a later turn.")
        if ref is None:
            self.on_answer("invalid", 0)
            return ("That is not a reference. Pass the `ctx:` and hex digits a compaction note names, "
                    "e.g. {\"ref\": \"ctx:7f3a91c2d4e5\"}.")
        if ref in self.served:
            self.on_answer("repeated", 0)
            return f"ref {ref} was already expanded in this turn: its content is in an earlier tool result."
        cfg = self.config
        text = await self.store.get(self.tenant, self.session_id, ref, cfg.store_ttl_s)
        if text is None:
            self.on_answer("missing", 0)
            return (f"Nothing is stored under ref {ref} for this conversation (it expired, or it is not one "
                    "of this conversation's references). Continue without it.")
        limit = cfg.result_tokens if self.room is None else min(cfg.result_tokens, self.room - CALL_TOKENS)
        if limit < MIN_RESULT_TOKENS:
            self.on_answer("no_room", 0)
            return (f"ref {ref} cannot be expanded in this turn: the conversation is at its context budget. "
                    "Continue without it, or ask again in a later turn.")
        parts = CutLog()
        text = excerpt(text, limit, self.counter, parts)
        if parts.originals:
            await self.store.put(self.tenant, self.session_id, parts.originals, cfg.store_max_bytes, cfg.store_ttl_s)
        tokens = self.served[ref] = self.counter.count(text)
        if self.room is not None:
            self.room -= tokens + CALL_TOKENS
        self.on_answer("served", tokens)
        return text


def _ref_of(arguments: str) -> str | None:
    """`ctx:HEX` from the call's JSON arguments (`{"ref": ...}`), however the model wrote it."""
    try:
        parsed = orjson.loads(arguments or b"{}")
    except orjson.JSONDecodeError:
        return None
    value = parsed.get("ref") if isinstance(parsed, dict) else parsed
    found = _REF.match(value.strip().lower()) if isinstance(value, str) else None
    return "ctx:" + found.group(1) if found else None


@dataclass
class AskedCalls:
    """A reply's calls of the expansion tool, and what else it asked for."""
    ours: list[ToolCall]
    others: int
    """The agent's own tool calls in the same reply (or other choices)."""
    assistant: Any
    """The reply's assistant turn with only our calls, in the door's own form, to append."""


class StreamExpansion(Protocol):
    """One streamed reply, read event by event (each a whole SSE event, its blank line included)."""

    def opening(self, event: bytes) -> bool | None:
        """True: the reply opens with a call of our tool; False: with anything else (text, the
        agent's call, its end); None: not known yet (a role-only chunk, a ping)."""
        ...

    def asked(self, events: list[bytes]) -> AskedCalls | None:
        """The whole reply's calls of our tool, once every event is in."""
        ...

    def filter(self, event: bytes) -> bytes:
        """The event with our calls taken out (b"" when nothing else was in it), the finish
        reason corrected when no call is left; the same bytes when it had none."""
        ...


@runtime_checkable
class ExpandingWire(Protocol):
    """What a door with tools adds to `Wire` to offer and answer the expansion tool."""

    async def send(self, route: Route, payload: dict[str, Any], *, stream: bool, api_key: str | None) -> Reply: ...

    def with_tool(self, payload: dict[str, Any], tool: dict[str, Any]) -> dict[str, Any]:
        """The payload with the tool (`tool_definition`) after the client's own tools."""
        ...

    def asked(self, body: bytes, tool_name: str) -> AskedCalls | None:
        """A whole reply's calls of the tool; None when it makes none."""
        ...

    def follow_up(self, payload: dict[str, Any], asked: AskedCalls,
                  results: list[tuple[ToolCall, str]]) -> dict[str, Any]:
        """The payload with the assistant's calls and their results appended, all before unchanged."""
        ...

    def exchange(self, asked: AskedCalls, results: list[tuple[ToolCall, str]]) -> list[dict[str, Any]]:
        """What `follow_up` appends, as neutral messages (rendered by the door like the rest)."""
        ...

    def without_ours(self, body: bytes, tool_name: str) -> bytes:
        """A whole reply with the tool's calls taken out and its stop reason corrected."""
        ...

    def stream_expansion(self, tool_name: str) -> StreamExpansion: ...


# The loop every door with tools runs around the upstream call.


class ExpandingTurn(Protocol):
    """What the loop needs of a planned turn (`turn.PreparedTurn` is one)."""
    expansion: Expansion | None
    payload: dict[str, Any] | None
    headers: dict[str, str]
    route: Route
    upstream_ms: float

    @property
    def api_key(self) -> str | None: ...

_EVENT_END = re.compile(rb"\r?\n\r?\n")
TOO_LONG = ("The original is too long for the model's context window now; continue without it, or re-run "
            "the tool that produced it.")


async def expanded(prepared: ExpandingTurn, wire: ExpandingWire, reply: Reply) -> Reply:
    """The reply the agent gets: the upstream's answer once every expansion it asked for is answered."""
    expansion = prepared.expansion
    assert expansion is not None and prepared.payload is not None
    try:
        if reply.chunks is None:
            return await _whole(prepared, expansion, wire, reply)
        return await _streamed(prepared, expansion, wire, reply)
    finally:
        prepared.headers["X-Ctx-Expansions"] = str(len(expansion.served))


async def _whole(prepared: ExpandingTurn, expansion: Expansion, wire: ExpandingWire, reply: Reply) -> Reply:
    while True:
        body = reply.body or b""
        asked = wire.asked(body, expansion.tool_name)
        if asked is None:
            return reply
        if asked.others or not expansion.may_continue():
            return replace(reply, body=wire.without_ours(body, expansion.tool_name))
        reply = await _ask_again(prepared, expansion, wire, asked, stream=False)


async def _streamed(prepared: ExpandingTurn, expansion: Expansion, wire: ExpandingWire, reply: Reply) -> Reply:
    while True:
        reader = wire.stream_expansion(expansion.tool_name)
        assert reply.chunks is not None
        events = _events(reply.chunks)
        held: list[bytes] = []
        opens_with_ours: bool | None = None
        try:
            async for event in events:
                held.append(event)
                opens_with_ours = reader.opening(event)
                if opens_with_ours is not None:
                    break
            if not opens_with_ours:
                return replace(reply, chunks=_filtered(held, events, reader))
            held += [event async for event in events]
        except BaseException:  # the client left while the stream was held: nobody relays it
            _close(reply)
            raise
        _close(reply)  # read whole: answered below, never relayed
        asked = reader.asked(held)
        if asked is None or asked.others or not expansion.may_continue():
            return replace(reply, chunks=_filtered(held, _nothing(), reader), close=None)
        reply = await _ask_again(prepared, expansion, wire, asked, stream=True)


async def _ask_again(prepared: ExpandingTurn, expansion: Expansion, wire: ExpandingWire, asked: AskedCalls,
                     stream: bool) -> Reply:
    """Answer every call of ours and send the conversation on, with no compaction: what was
    just expanded is not cut again in the same turn. An upstream that finds it too long is
    told so in the results instead, once; that is the model's answer, never the loop guard's."""
    assert prepared.payload is not None
    results: list[tuple[ToolCall, str]] = [(call, await expansion.answer(call)) for call in asked.ours]
    expansion.rounds += 1
    api_key = prepared.api_key
    payload = wire.follow_up(prepared.payload, asked, results)
    try:
        reply = await wire.send(prepared.route, payload, stream=stream, api_key=api_key)
    except ContextTooLong:
        results = [(call, TOO_LONG) for call, _ in results]
        payload = wire.follow_up(prepared.payload, asked, results)
        try:
            reply = await wire.send(prepared.route, payload, stream=stream, api_key=api_key)
        except UpstreamError as e:
            raise e.to_api_error() from None
    except UpstreamError as e:
        raise e.to_api_error() from None
    prepared.payload = payload
    prepared.upstream_ms += reply.upstream_ms
    expansion.exchange += wire.exchange(asked, results)
    return reply


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole SSE events, each with its blank line; what is left at the end, as it is."""
    pending = b""
    async for data in chunks:
        pending += data
        start = 0
        for end in _EVENT_END.finditer(pending):
            yield pending[start:end.end()]
            start = end.end()
        pending = pending[start:]
    if pending:
        yield pending


async def _filtered(held: list[bytes], rest: AsyncIterator[bytes], reader: StreamExpansion) -> AsyncIterator[bytes]:
    for event in held:
        if out := reader.filter(event):
            yield out
    async for event in rest:
        if out := reader.filter(event):
            yield out


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield


def _close(reply: Reply) -> None:
    if reply.close is not None:
        reply.close()
