"""The last request of each recent session, kept in this process, so a steady turn pays
only for what is new in it.

A stateless client resends its whole history every turn. When a request starts with exactly
the messages of its session's last request (one list comparison, done in C), the door
validates only the messages after them and the engine extends the last `HistoryIndex`
instead of fingerprinting and counting the whole history again. A miss (another replica or
worker served the last turn, the client rewrote its history, the entry was evicted) costs
what a turn cost without the cache: everything is recomputed, nothing else changes.

Equal means equal as Python compares parsed JSON, where `1`, `1.0` and `true` are equal: a
message whose only change is between those keeps its earlier fingerprint. Validation is not
affected (every field it checks is a string, and no string equals a number).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ctxgate.pipeline.history_index import HistoryIndex

Message = dict[str, Any]
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_SESSIONS = 1024
"""An agent's session sends a turn every few seconds: a process serves far fewer sessions at
once than this, and a new conversation that never comes back must not hold memory long."""
ENTRY_OVERHEAD = 2048
"""What an entry weighs besides its body: the index's lists, the key, the bookkeeping."""


@dataclass(frozen=True)
class KnownPrefix:
    """How many leading messages of a request its session's last request had, and their index."""
    length: int
    index: HistoryIndex | None


NOTHING_KNOWN = KnownPrefix(0, None)


@dataclass
class _Entry:
    messages: list[Message]
    index: HistoryIndex
    size: int
    door_state: Any


class HistoryCache:
    """Bounded by the request sizes it holds (the parsed messages take about as much) and by
    the number of sessions; the least recently used go first."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._bytes = 0
        self._max = max_bytes
        self._max_sessions = max_sessions
        self.hits = 0
        self.misses = 0

    def match(self, tenant: str, session_id: str, messages: list[Message]) -> KnownPrefix:
        entry = self._entries.get((tenant, session_id))
        if entry is not None:
            n = len(entry.messages)
            if len(messages) >= n and messages[:n] == entry.messages:
                self.hits += 1
                return KnownPrefix(n, entry.index)
            if len(messages) < n and messages == entry.messages[:len(messages)]:  # a retry of an earlier turn
                self.hits += 1
                return KnownPrefix(len(messages), entry.index)
        self.misses += 1
        return NOTHING_KNOWN

    def door_state(self, tenant: str, session_id: str) -> Any:
        """What the door that served the session's last request kept of its own reading of it
        (the Responses door: its items and the messages they became), or None."""
        entry = self._entries.get((tenant, session_id))
        return entry.door_state if entry is not None else None

    def remember(self, tenant: str, session_id: str, messages: list[Message], index: HistoryIndex,
                 size: int, door_state: Any = None) -> None:
        """`messages` as this request had them (a copy of the list is kept: callers may build
        on theirs); `size` is what they weigh, the request body's bytes."""
        key = (tenant, session_id)
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.size
        size += ENTRY_OVERHEAD
        if size > self._max:
            return
        self._entries[key] = _Entry(list(messages), index, size, door_state)
        self._bytes += size
        while self._bytes > self._max or len(self._entries) > self._max_sessions:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size

    def forget(self, tenant: str, session_id: str) -> None:
        old = self._entries.pop((tenant, session_id), None)
        if old is not None:
            self._bytes -= old.size

    def __len__(self) -> int:
        return len(self._entries)
