"""What compaction cut, kept by reference so the model can ask for it back (docs/expansion.md).

Originals are keyed by tenant, session and reference: a lookup names all three, so a
reference copied from another tenant's or session's conversation finds nothing. Each
session keeps at most `max_bytes` of originals (the oldest go first) for at most `ttl_s`
seconds. The session state holds none of it: a session's state is loaded and saved every
turn, and originals are read only when the model asks.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Protocol

MAX_SESSIONS = 10_000
"""Sessions with originals held in one process; the least recently written go first."""


class ContentStore(Protocol):
    async def put(self, tenant: str, session_id: str, originals: dict[str, str], max_bytes: int,
                  ttl_s: float) -> None: ...

    async def get(self, tenant: str, session_id: str, ref: str, ttl_s: float) -> str | None: ...


class MemoryContentStore:
    """In the process, beside in-process session state."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[tuple[str, str], OrderedDict[str, tuple[str, float, int]]] = OrderedDict()
        """(tenant, session) -> ref -> (original, when kept, its size in bytes), oldest first."""

    async def put(self, tenant: str, session_id: str, originals: dict[str, str], max_bytes: int,
                  ttl_s: float) -> None:
        if not originals:
            return
        key = (tenant, session_id)
        kept = self._sessions.setdefault(key, OrderedDict())
        self._sessions.move_to_end(key)
        now = time.time()
        for ref, text in originals.items():
            kept[ref] = (text, now, len(text.encode()))
            kept.move_to_end(ref)
        size = sum(entry[2] for entry in kept.values())
        while kept and (size > max_bytes or next(iter(kept.values()))[1] < now - ttl_s):
            size -= kept.popitem(last=False)[1][2]
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)

    async def get(self, tenant: str, session_id: str, ref: str, ttl_s: float) -> str | None:
        kept = self._sessions.get((tenant, session_id))
        found = kept.get(ref) if kept is not None else None
        if found is None or found[1] < time.time() - ttl_s:
            return None
        return found[0]
