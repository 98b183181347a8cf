"""The expansion loop every door with tools runs around the upstream call (docs/expansion.md).

A reply whose only tool calls are the gateway's own is not returned: each call is answered
from the content store, appended with its result after everything that was sent (so the
prefix the provider caches is unchanged), and the upstream is asked again, at most
`expand.max_per_turn` times, then once more with results that only say the limit is reached
(a reply that still asks is returned with its calls taken out). A reply that mixes our calls
with the agent's is returned with ours taken out: the agent's calls are never held back or
lost, and the model may ask again next turn. A streamed reply is held only until it shows
what it opens with: text, or the agent's call, flows from there as usual (our calls, if any
come later, are taken out).
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import AsyncIterator

from ..engine.expansion import AskedCalls, Expansion, ExpandingWire, StreamExpansion, ToolCall
from ..engine.turn import PreparedTurn, upstream_key
from ..upstream.errors import ContextTooLong, UpstreamError
from ..upstream.forwarders import Reply

_EVENT_END = re.compile(rb"\r?\n\r?\n")
TOO_LONG = ("The original is too long for the model's context window now; continue without it, or re-run "
            "the tool that produced it.")


async def expanded(prepared: PreparedTurn, wire: ExpandingWire, reply: Reply) -> Reply:
    """The reply the agent gets: the upstream's answer once every expansion it asked for is answered."""
    expansion = prepared.expansion
    assert expansion is not None and prepared.payload is not None
    try:
        if reply.chunks is None:
            return await _whole(prepared, expansion, wire, reply)
        return await _streamed(prepared, expansion, wire, reply)
    finally:
        prepared.headers["X-Ctx-Expansions"] = str(len(expansion.served))


async def _whole(prepared: PreparedTurn, expansion: Expansion, wire: ExpandingWire, reply: Reply) -> Reply:
    while True:
        body = reply.body or b""
        asked = wire.asked(body, expansion.tool_name)
        if asked is None:
            return reply
        if asked.others or not expansion.may_continue():
            return replace(reply, body=wire.without_ours(body, expansion.tool_name))
        reply = await _ask_again(prepared, expansion, wire, asked, stream=False)


async def _streamed(prepared: PreparedTurn, expansion: Expansion, wire: ExpandingWire, reply: Reply) -> Reply:
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


async def _ask_again(prepared: PreparedTurn, expansion: Expansion, wire: ExpandingWire, asked: AskedCalls,
                     stream: bool) -> Reply:
    """Answer every call of ours and send the conversation on, with no compaction: what was
    just expanded is not cut again in the same turn. An upstream that finds it too long is
    told so in the results instead, once; that is the model's answer, never the loop guard's."""
    assert prepared.payload is not None
    results: list[tuple[ToolCall, str]] = [(call, await expansion.answer(call)) for call in asked.ours]
    expansion.rounds += 1
    api_key = upstream_key(prepared.caller, prepared.route)
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
