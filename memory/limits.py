"""Per-tenant caps on long-term memory (`ctxgate.memory.max_entries`, `max_bytes`).

Every write goes through a `BoundedStore`. An entry's size is its content and data as
UTF-8 JSON. A write from the API that would pass a cap raises `MemoryFull` and changes
nothing. A write from capture (auto-dream, the project scan) first evicts the tenant's
captured entries, quarantined ones first, then the least recently updated — never an entry
a client wrote through the API —
and is skipped (logged) when even that cannot make room. Expired entries are purged before
a cap is judged. Within one process the check and the write are one step per tenant;
replicas sharing a store may together pass a cap by the writes they make at the same time.
"""
from __future__ import annotations

import asyncio
import builtins
import logging
import time
from typing import Callable

import orjson

from .config import MemoryConfig
from .entries import Category, MemoryEntry
from .store import LongTermStore

log = logging.getLogger("ctxgate.memory")


class MemoryFull(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def entry_bytes(entry: MemoryEntry) -> int:
    return len(orjson.dumps(entry.content)) + len(orjson.dumps(entry.data))


def _sizes(entries: list[MemoryEntry]) -> dict[str, int]:
    return {e.id: entry_bytes(e) for e in entries}


class BoundedStore:
    """A LongTermStore whose `put` respects the tenant's caps. `captured`: this view writes
    what capture found (marked `origin: capture`), evicting to make room."""

    def __init__(self, store: LongTermStore, config: MemoryConfig, *, captured: bool = False,
                 locks: dict[str, asyncio.Lock] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.inner = store
        self.config = config
        self.captured = captured
        self.locks: dict[str, asyncio.Lock] = {} if locks is None else locks
        self._clock = clock

    def capturing(self) -> BoundedStore:
        """The view capture writes through: the same store, caps and per-tenant locks."""
        return BoundedStore(self.inner, self.config, captured=True, locks=self.locks, clock=self._clock)

    async def put(self, entry: MemoryEntry) -> None:
        if self.captured:
            entry.origin = "capture"
        async with self.locks.setdefault(entry.tenant, asyncio.Lock()):
            kept = await self._unexpired(entry.tenant)
            others = [e for e in kept if e.id != entry.id]
            sizes = await asyncio.to_thread(_sizes, [*others, entry])
            evict = self._to_evict(entry, others, sizes)
            if evict is None:
                return
            for old in evict:
                await self.inner.delete(entry.tenant, old.id)
            await self.inner.put(entry)

    def _to_evict(self, entry: MemoryEntry, others: list[MemoryEntry],
                  sizes: dict[str, int]) -> list[MemoryEntry] | None:
        """What must go for `entry` to fit: [] when it fits; None (captured) when it cannot."""
        count, used = len(others) + 1, sum(sizes.values())
        limit_n, limit_b = self.config.max_entries, self.config.max_bytes
        if count <= limit_n and used <= limit_b:
            return []
        if not self.captured:
            if count > limit_n:
                raise MemoryFull(f"this tenant's memory holds {len(others)} entries, its cap "
                                 f"(ctxgate.memory.max_entries {limit_n}); delete some first", "memory_full")
            raise MemoryFull(f"this entry ({sizes[entry.id]} bytes) would take this tenant's memory to {used} bytes, "
                             f"over its cap (ctxgate.memory.max_bytes {limit_b}); delete some first",
                             "memory_full")
        evict: list[MemoryEntry] = []
        # Quarantined entries (never injected) make room first, then the least recently updated.
        for old in sorted((e for e in others if e.origin == "capture"),
                          key=lambda e: (not e.quarantined, e.updated_at, e.id)):
            if count <= limit_n and used <= limit_b:
                break
            evict.append(old)
            count, used = count - 1, used - sizes[old.id]
        if count <= limit_n and used <= limit_b:
            log.info("memory of tenant %s full: %d captured entries evicted", entry.tenant, len(evict))
            return evict
        log.warning("memory of tenant %s full: captured %s entry skipped (%d bytes)", entry.tenant,
                    entry.category.value, sizes[entry.id])
        return None

    async def _unexpired(self, tenant: str) -> builtins.list[MemoryEntry]:
        now = self._clock()
        entries = await self.inner.list(tenant)
        if any(e.expired(now) for e in entries):
            await self.inner.purge_expired(tenant, now)
            entries = [e for e in entries if not e.expired(now)]
        return entries

    async def get(self, tenant: str, entry_id: str) -> MemoryEntry | None:
        return await self.inner.get(tenant, entry_id)

    async def delete(self, tenant: str, entry_id: str) -> bool:
        return await self.inner.delete(tenant, entry_id)

    async def list(self, tenant: str, category: Category | None = None,
                   now: float | None = None) -> builtins.list[MemoryEntry]:
        return await self.inner.list(tenant, category, now)

    async def search(self, tenant: str, query: str, categories: tuple[Category, ...], user: str | None,
                     project: str | None, limit: int, now: float) -> builtins.list[tuple[MemoryEntry, float]]:
        return await self.inner.search(tenant, query, categories, user, project, limit, now)

    async def version(self, tenant: str) -> int:
        return await self.inner.version(tenant)

    async def purge_expired(self, tenant: str, now: float) -> int:
        return await self.inner.purge_expired(tenant, now)

    async def close(self) -> None:
        await self.inner.close()
