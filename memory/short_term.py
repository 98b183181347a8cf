"""The short-term buffer (docs/memory.md): what a session taught, until auto-dream
consolidates it. In memory, per session, guarded by an asyncio.Lock."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from .entries import Category

SessionKey = tuple[str, str]
"""(tenant, session id)."""
_SEEN_LIMIT = 20_000


@dataclass
class Candidate:
    """Something capture found, not yet long-term memory."""
    category: Category | None
    """None: the rules could not place it (an optional LLM classifier may)."""
    content: str
    data: dict[str, Any] = field(default_factory=dict)
    captured_at: float = field(default_factory=time.time)


@dataclass
class BufferScope:
    """Who a session's memory belongs to, and how it is consolidated."""
    user: str | None
    project: str | None
    profile: str
    model: str | None


@dataclass
class SessionBuffer:
    tenant: str
    user: str | None
    project: str | None
    profile: str = "professional"
    model: str | None = None
    """The model of the session's requests: who consolidates when no dream model is configured."""
    entries: list[Candidate] = field(default_factory=list)
    seen: dict[str, None] = field(default_factory=dict)
    """Fingerprints of messages already captured (the client resends its whole history)."""
    last_seen_at: float = field(default_factory=time.time)
    last_dream_at: float = field(default_factory=time.time)


class ShortTermStore:
    def __init__(self, max_sessions: int = 10_000) -> None:
        self._buffers: dict[SessionKey, SessionBuffer] = {}
        self.lock = asyncio.Lock()
        self.max_sessions = max_sessions
        """Past this many buffers, the empty ones go (`_forget_empty`)."""

    async def add(self, key: SessionKey, scope: "BufferScope", fingerprint_list: list[str],
                  found: list[tuple[int, Candidate]], now: float) -> tuple[SessionBuffer, bool]:
        """Buffer what capture found in messages not seen before; returns the session's buffer
        and whether this is the session's first sight."""
        async with self.lock:
            buf = self._buffers.get(key)
            first = buf is None
            if buf is None:
                buf = self._buffers[key] = SessionBuffer(key[0], scope.user, scope.project, last_dream_at=now)
                if len(self._buffers) > self.max_sessions:
                    self._forget_empty()
            buf.user, buf.project = scope.user or buf.user, scope.project or buf.project
            buf.profile, buf.model, buf.last_seen_at = scope.profile, scope.model, now
            fresh = {i for i, fp in enumerate(fingerprint_list) if fp not in buf.seen}
            buf.entries += [c for i, c in found if i in fresh]
            for i in fresh:
                buf.seen[fingerprint_list[i]] = None
            while len(buf.seen) > _SEEN_LIMIT:
                buf.seen.pop(next(iter(buf.seen)))
            return buf, first

    def _forget_empty(self) -> None:
        """The buffers that hold no candidate go, oldest first, down to 90% of `max_sessions`:
        a conversation that never comes back must not hold memory. One that does comes back
        unseen: its messages are read for candidates again, and none were found the first time."""
        target = self.max_sessions * 9 // 10
        for key in [k for k, b in self._buffers.items() if not b.entries]:
            if len(self._buffers) <= target:
                break
            del self._buffers[key]

    def __len__(self) -> int:
        return len(self._buffers)

    def unseen(self, key: SessionKey, fingerprint_list: list[str]) -> set[int]:
        buf = self._buffers.get(key)
        return set(range(len(fingerprint_list))) if buf is None else {
            i for i, fp in enumerate(fingerprint_list) if fp not in buf.seen}

    async def drain(self, key: SessionKey, now: float) -> tuple[SessionBuffer | None, list[Candidate]]:
        async with self.lock:
            buf = self._buffers.get(key)
            if buf is None:
                return None, []
            taken, buf.entries, buf.last_dream_at = buf.entries, [], now
            return buf, taken

    async def forget(self, key: SessionKey) -> None:
        async with self.lock:
            self._buffers.pop(key, None)

    async def idle(self, now: float, idle_s: float) -> list[SessionKey]:
        async with self.lock:
            return [k for k, b in self._buffers.items() if now - b.last_seen_at > idle_s]

    async def keys(self) -> list[SessionKey]:
        async with self.lock:
            return list(self._buffers)

    def get(self, key: SessionKey) -> SessionBuffer | None:
        return self._buffers.get(key)
