"""Opening the session store `ctxgate.state` names: in this process, or in Redis. Apart from
`state.py`, which the Redis store builds on, so neither imports the other back."""
from __future__ import annotations

from .redis_state import RedisSessionStore
from .state import MemorySessionStore, SessionStore


def open_store(url: str, max_memory_sessions: int = 10_000, idle_ttl_s: float = 3600.0) -> SessionStore:
    if url == "memory":
        return MemorySessionStore(max_memory_sessions, idle_ttl_s)
    return RedisSessionStore(url)
