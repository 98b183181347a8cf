"""The long-term store: one interface, three backends (JSON files, Redis, Qdrant).

Every call names the tenant; a backend never returns another tenant's entry. `version`
changes whenever a tenant's memory changes, so the loader can keep an injected block
byte-identical until then (the provider's prompt cache keeps hitting).
"""
from __future__ import annotations

import builtins
from typing import Protocol

from .entries import Category, MemoryEntry


class LongTermStore(Protocol):
    async def put(self, entry: MemoryEntry) -> None:
        """Insert, or replace the entry with the same id (in the same tenant)."""

    async def get(self, tenant: str, entry_id: str) -> MemoryEntry | None: ...

    async def delete(self, tenant: str, entry_id: str) -> bool: ...

    async def list(self, tenant: str, category: Category | None = None,
                   now: float | None = None) -> builtins.list[MemoryEntry]:
        """The tenant's entries (of one category), expired ones left out when `now` is given."""

    async def search(self, tenant: str, query: str, categories: tuple[Category, ...], user: str | None,
                     project: str | None, limit: int, now: float) -> builtins.list[tuple[MemoryEntry, float]]:
        """The entries visible to (user, project), most relevant to `query` first, with scores."""

    async def version(self, tenant: str) -> int: ...

    async def purge_expired(self, tenant: str, now: float) -> int:
        """Remove expired entries (feedback TTL); returns how many."""

    async def close(self) -> None: ...
