"""What compaction cut, kept by reference so the model can ask for it back (docs/expansion.md).

Originals are keyed by tenant, session and reference: a lookup names all three, so a
reference copied from another tenant's or session's conversation finds nothing. Each
session keeps at most `max_bytes` of originals (the oldest go first) for at most `ttl_s`
seconds. The session state holds none of it: a session's state is loaded and saved every
turn, and originals are read only when the model asks. Three backends: in the process (an
offline replay), in files beside the WAL (in-process session state), or in Redis (shared by
replicas).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from ctxgate.redis_backend import RedisTarget

MAX_SESSIONS = 10_000
"""Sessions with originals held in one process; the least recently written go first."""


class ContentStore(Protocol):
    async def put(self, tenant: str, session_id: str, originals: dict[str, str], max_bytes: int,
                  ttl_s: float) -> None: ...

    async def get(self, tenant: str, session_id: str, ref: str, ttl_s: float) -> str | None: ...

    async def prune(self, ttl_s: float) -> int:
        """Drop what is past its age in every session, those that never write again included;
        how many originals went."""
        ...

    async def erase(self, tenant: str, session_id: str) -> int:
        """Drop every original of the session (deleting its data); how many."""
        ...

    async def close(self) -> None: ...


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

    async def prune(self, ttl_s: float) -> int:
        oldest_kept, removed = time.time() - ttl_s, 0
        for key, kept in list(self._sessions.items()):
            while kept and next(iter(kept.values()))[1] < oldest_kept:
                kept.popitem(last=False)
                removed += 1
            if not kept:
                del self._sessions[key]
        return removed

    async def erase(self, tenant: str, session_id: str) -> int:
        return len(self._sessions.pop((tenant, session_id), {}))

    async def close(self) -> None:
        self._sessions.clear()


class RedisContentStore:
    """In Redis: each original under `ctxgate:content:<tenant>:<session>:<ref>` with its age as a
    TTL, and per session the references in the order they were kept (`...:order`), so the
    oldest go first past `max_bytes`."""

    def __init__(self, url: str) -> None:
        self._target = RedisTarget.parse(url)
        self._redis = self._target.async_client()

    def _key(self, tenant: str, session_id: str) -> str:
        return f"ctxgate:content:{self._target.tag(tenant, session_id)}{tenant}:{session_id}"

    async def put(self, tenant: str, session_id: str, originals: dict[str, str], max_bytes: int,
                  ttl_s: float) -> None:
        if not originals:
            return
        base, ttl = self._key(tenant, session_id), max(1, int(ttl_s))
        async with self._redis.pipeline(transaction=True) as pipe:
            for ref, text in originals.items():
                pipe.set(f"{base}:{ref}", text.encode(), ex=ttl)
                pipe.lrem(f"{base}:order", 0, ref)
                pipe.rpush(f"{base}:order", ref)
            pipe.expire(f"{base}:order", ttl)
            await pipe.execute()
        refs = [_text(r) for r in await self._redis.lrange(f"{base}:order", 0, -1)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for ref in refs:
                pipe.strlen(f"{base}:{ref}")
            sizes: list[int] = await pipe.execute()  # one round trip, however many originals
        total = sum(sizes)
        for ref, size in zip(refs, sizes):
            if size and total <= max_bytes:
                break
            await self._redis.delete(f"{base}:{ref}")  # too old (gone already), or the oldest past the size
            await self._redis.lrem(f"{base}:order", 1, ref)
            total -= size

    async def get(self, tenant: str, session_id: str, ref: str, ttl_s: float) -> str | None:
        raw = await self._redis.get(f"{self._key(tenant, session_id)}:{ref}")
        return _text(raw) if raw is not None else None

    async def prune(self, ttl_s: float) -> int:
        return 0  # every key carries its age as a TTL: Redis drops them itself

    async def erase(self, tenant: str, session_id: str) -> int:
        base = self._key(tenant, session_id)
        refs = [_text(r) for r in await self._redis.lrange(f"{base}:order", 0, -1)]
        removed = int(await self._redis.delete(*(f"{base}:{ref}" for ref in refs))) if refs else 0
        await self._redis.delete(f"{base}:order")
        return removed

    async def close(self) -> None:
        await self._redis.aclose()


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def open_content_store(state_url: str, data_dir: Path) -> ContentStore:
    """Where the session state lives, or what rebuilds it: in the same Redis, or for in-process
    state in files beside the WAL (a restart rebuilds the session from the log, and its notes
    still name these originals). `MemoryContentStore` serves in-process runs (`ctxgate replay`)."""
    if state_url == "memory":
        from .content_files import FileContentStore

        return FileContentStore(data_dir)
    return RedisContentStore(state_url)
