"""The short-term buffer (docs/memory.md): what a session taught, until auto-dream
consolidates it.

`ShortTermStore` is what the memory manager asks of a buffer store; `LocalShortTermStore`
keeps the buffers in this process (one gateway, state in memory), `RedisShortTermStore`
(memory/redis_short_term.py) in Redis beside the session state, where every replica sees
them and a replica killed with -9 loses none.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .entries import Category

SessionKey = tuple[str, str]
"""(tenant, session id)."""
SEEN_LIMIT = 20_000
"""Fingerprints remembered per session, the oldest dropped first."""


@dataclass
class Candidate:
    """Something capture found, not yet long-term memory."""
    category: Category | None
    """None: the rules could not place it (an optional LLM classifier may)."""
    content: str
    data: dict[str, Any] = field(default_factory=dict)
    captured_at: float = field(default_factory=time.time)
    source: str = "human"
    """What produced the text (`entries.SourceKind`)."""
    span: str = ""
    """The verbatim text it came from (capped)."""
    turn: int | None = None
    door: str | None = None


@dataclass
class BufferScope:
    """Who a session's memory belongs to, and how it is consolidated."""
    user: str | None
    project: str | None
    profile: str
    model: str | None
    door: str | None = None
    """Where the turn came in (chat, messages, responses): kept with what it taught."""
    turn: int | None = None
    """The session's turn number."""


@dataclass
class SessionBuffer:
    """Whose a buffer is and when it was last fed and consolidated (its candidates are kept
    apart: `add` and `peek` report them)."""
    tenant: str
    user: str | None
    project: str | None
    profile: str = "professional"
    model: str | None = None
    """The model of the session's requests: who consolidates when no dream model is configured."""
    last_seen_at: float = field(default_factory=time.time)
    last_dream_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Added:
    """What `add` did: the session's buffer, whether it was its first sight, and how many
    candidates the buffer holds now."""
    buffer: SessionBuffer
    first: bool
    size: int


class ShortTermStore(Protocol):
    async def add(self, key: SessionKey, scope: BufferScope, fingerprint_list: list[str],
                  found: list[tuple[int, Candidate]], now: float) -> Added:
        """Buffer the candidates `found` (by message index) in messages not seen before."""

    def unseen(self, key: SessionKey, fingerprint_list: list[str]) -> set[int]:
        """The indexes of messages this process may not have captured yet (a superset of the
        unseen ones: `add` keeps only what no replica saw)."""

    async def peek(self, key: SessionKey) -> tuple[SessionBuffer | None, list[Candidate]]:
        """The buffer and its candidates, unchanged."""

    async def drain(self, key: SessionKey, now: float) -> tuple[SessionBuffer | None, list[Candidate]]:
        """Take the candidates out, atomically: two replicas draining one buffer never both get them."""

    async def forget(self, key: SessionKey, seen_at: float) -> None:
        """The session ended: its buffer goes, unless a turn fed it after `seen_at` (the
        session came back, on this replica or another, while it was being ended)."""

    async def idle(self, now: float, idle_s: float) -> list[SessionKey]:
        """The sessions no turn fed for `idle_s`."""

    async def left_at_close(self) -> list[SessionKey]:
        """The sessions to end when this gateway stops: all of them when the buffers die with
        the process, none when they outlive it."""

    async def close(self) -> None: ...


@dataclass
class _Held:
    buffer: SessionBuffer
    entries: list[Candidate] = field(default_factory=list)
    seen: dict[str, None] = field(default_factory=dict)
    """Fingerprints of messages already captured (the client resends its whole history)."""


class LocalShortTermStore:
    """In this process, per session, guarded by an asyncio.Lock."""

    def __init__(self, max_sessions: int = 10_000) -> None:
        self._buffers: dict[SessionKey, _Held] = {}
        self.lock = asyncio.Lock()
        self.max_sessions = max_sessions
        """Past this many buffers, the empty ones go (`_forget_empty`)."""

    async def add(self, key: SessionKey, scope: BufferScope, fingerprint_list: list[str],
                  found: list[tuple[int, Candidate]], now: float) -> Added:
        async with self.lock:
            held = self._buffers.get(key)
            first = held is None
            if held is None:
                held = self._buffers[key] = _Held(SessionBuffer(key[0], scope.user, scope.project, last_dream_at=now))
                if len(self._buffers) > self.max_sessions:
                    self._forget_empty()
            buf = held.buffer
            buf.user, buf.project = scope.user or buf.user, scope.project or buf.project
            buf.profile, buf.model, buf.last_seen_at = scope.profile, scope.model, now
            fresh = {i for i, fp in enumerate(fingerprint_list) if fp not in held.seen}
            held.entries += [c for i, c in found if i in fresh]
            for i in fresh:
                held.seen[fingerprint_list[i]] = None
            while len(held.seen) > SEEN_LIMIT:
                held.seen.pop(next(iter(held.seen)))
            return Added(buf, first, len(held.entries))

    def _forget_empty(self) -> None:
        """The buffers that hold no candidate go, oldest first, down to 90% of `max_sessions`:
        a conversation that never comes back must not hold memory. One that does comes back
        unseen: its messages are read for candidates again, and none were found the first time."""
        target = self.max_sessions * 9 // 10
        for key in [k for k, held in self._buffers.items() if not held.entries]:
            if len(self._buffers) <= target:
                break
            del self._buffers[key]

    def __len__(self) -> int:
        return len(self._buffers)

    def unseen(self, key: SessionKey, fingerprint_list: list[str]) -> set[int]:
        held = self._buffers.get(key)
        return set(range(len(fingerprint_list))) if held is None else {
            i for i, fp in enumerate(fingerprint_list) if fp not in held.seen}

    async def peek(self, key: SessionKey) -> tuple[SessionBuffer | None, list[Candidate]]:
        held = self._buffers.get(key)
        return (None, []) if held is None else (replace(held.buffer), list(held.entries))

    async def drain(self, key: SessionKey, now: float) -> tuple[SessionBuffer | None, list[Candidate]]:
        async with self.lock:
            held = self._buffers.get(key)
            if held is None:
                return None, []
            taken, held.entries, held.buffer.last_dream_at = held.entries, [], now
            return held.buffer, taken

    async def forget(self, key: SessionKey, seen_at: float) -> None:
        async with self.lock:
            held = self._buffers.get(key)
            if held is not None and held.buffer.last_seen_at <= seen_at:
                del self._buffers[key]

    async def idle(self, now: float, idle_s: float) -> list[SessionKey]:
        async with self.lock:
            return [k for k, held in self._buffers.items() if now - held.buffer.last_seen_at > idle_s]

    async def left_at_close(self) -> list[SessionKey]:
        async with self.lock:
            return list(self._buffers)

    async def close(self) -> None:
        """Nothing held outside this process."""
