"""What every door's stream watch shares (`engine.wire.StreamWatch`): every byte kept when
asked (an idempotent request's stored reply), whole lines across network chunks (a chunk
may end mid-event), and whether the stream completed or carried an error. And `SseEvents`,
the edge's check that what it relays is whole events of JSON; `event_data` and `with_data`,
one event read and rewritten (the expansion loop takes its tool's calls out); `rewrite_events`,
a stream's JSON events each rewritten (the native context-management replies)."""
from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson


class SseWatch:
    def __init__(self, keep_all: bool) -> None:
        self._partial = b""
        """The end of the last chunk after its last newline."""
        self._all: bytearray | None = bytearray() if keep_all else None
        self._done = False
        self._failed = False

    @property
    def complete(self) -> bool:
        return self._done

    @property
    def failed(self) -> bool:
        return self._failed

    def body(self) -> bytes:
        return bytes(self._all) if self._all is not None else b""

    def _lines(self, data: bytes) -> list[bytes]:
        """The lines `data` completes (kept, when asked to keep every byte)."""
        if self._all is not None:
            self._all += data
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return lines


_EVENT_END = re.compile(rb"\r?\n\r?\n")


class SseEvents:
    """Cuts an upstream's SSE bytes into whole events, as they arrive, and checks that each
    event's data is JSON (or chat's `[DONE]`). The edge relays only whole, checked events, so
    a client never reads half an event nor one its SDK cannot parse; the bytes it relays are
    the upstream's, unchanged, only cut at other places."""

    def __init__(self) -> None:
        self._pending = b""

    def push(self, data: bytes) -> tuple[bytes, str | None]:
        """The whole events `data` completes, and what is wrong with the first event that is
        not JSON (None when all are fine); nothing from that event on is returned."""
        self._pending += data
        ready = 0
        for end in _EVENT_END.finditer(self._pending):
            problem = _problem(self._pending[ready:end.start()])
            if problem is not None:
                return self._take(ready), problem
            ready = end.end()
        return self._take(ready), None

    def rest(self) -> tuple[bytes, str | None]:
        """At the end of the stream: what is left of an event that was never finished."""
        rest, self._pending = self._pending, b""
        problem = _problem(rest)
        return (b"", problem) if problem is not None else (rest, None)

    def _take(self, size: int) -> bytes:
        ready, self._pending = self._pending[:size], self._pending[size:]
        return ready


def _problem(event: bytes) -> str | None:
    """Why one event's data (its `data:` lines, joined) is not JSON; None when it is, or has none."""
    lines = [line[5:].removeprefix(b" ") for line in event.replace(b"\r\n", b"\n").split(b"\n")
             if line.startswith(b"data:")]
    if not lines:
        return None
    data = b"\n".join(lines)
    if data == b"[DONE]":
        return None
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError:
        return f"an event whose data is not JSON: {data[:200].decode('utf-8', 'replace')!r}"
    return None


def event_data(event: bytes) -> dict[str, Any] | None:
    """The JSON object of one whole event's first `data:` line; None for a comment, `[DONE]`,
    or anything else."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                found = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return None
            return found if isinstance(found, dict) else None
    return None


def with_data(event: bytes, data: dict[str, Any]) -> bytes:
    """The event with its data rewritten, its `event:` line kept."""
    lines = [line for line in event.split(b"\n") if line.startswith(b"event:")]
    return b"\n".join([*lines, b"data: " + orjson.dumps(data)]) + b"\n\n"


async def rewrite_events(chunks: AsyncIterator[bytes],
                         rewrite: Callable[[bytes, dict[str, Any]], bytes]) -> AsyncIterator[bytes]:
    """`chunks` as whole events, each JSON event replaced by what `rewrite(event, data)` returns
    (bytes ending in a blank line, or several events), the others relayed as they came."""
    pending = b""
    async for data in chunks:
        pending += data.replace(b"\r\n", b"\n")
        *events, pending = pending.split(b"\n\n")
        out = []
        for event in events:
            found = event_data(event)
            out.append(event + b"\n\n" if found is None else rewrite(event, found))
        if out:
            yield b"".join(out)
    if pending:
        yield pending
