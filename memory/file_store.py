"""The default long-term store: one JSON file per tenant and category,
`<data_dir>/memory/<tenant>/<category>.json`.

Writes are atomic (temp file, fsync, rename) under a `filelock` lock per tenant, so two
processes sharing the directory never lose each other's writes; reads are served from a
per-tenant view rebuilt only when a file changed (its mtime and size).
"""
from __future__ import annotations

import asyncio
import builtins
from pathlib import Path

import orjson
import xxhash
from filelock import FileLock
from pydantic import TypeAdapter

from ..wal.archive import write_atomically
from ..wal.paths import safe_name
from .entries import Category, MemoryEntry
from .ranking import TenantView

_ENTRIES = TypeAdapter(list[MemoryEntry])
"""Validates a whole category file from its bytes (pydantic's fast path, no dicts in between)."""


class FileMemoryStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._views: dict[str, TenantView] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _dir(self, tenant: str) -> Path:
        return self.root / safe_name(tenant)

    def _file(self, tenant: str, category: Category) -> Path:
        return self._dir(tenant) / f"{category.value}.json"

    def _version(self, tenant: str) -> int:
        """The files' mtimes and sizes, hashed: the same in every process sharing the directory."""
        stamp = []
        for category in Category:
            try:
                st = self._file(tenant, category).stat()
            except FileNotFoundError:
                continue
            stamp.append(f"{category.value}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}")
        return xxhash.xxh64_intdigest("|".join(stamp).encode()) if stamp else 0

    def _read(self, tenant: str, category: Category) -> dict[str, MemoryEntry]:
        try:
            raw = self._file(tenant, category).read_bytes()
        except FileNotFoundError:
            return {}
        return {e.id: e for e in _ENTRIES.validate_json(raw)}

    def _view(self, tenant: str) -> TenantView:
        version = self._version(tenant)
        view = self._views.get(tenant)
        if view is None or view.version != version:
            entries = [e for c in Category for e in self._read(tenant, c).values()]
            view = self._views[tenant] = TenantView(version, entries)
        return view

    async def _change(self, tenant: str, category: Category, change) -> bool:  # type: ignore[no-untyped-def]
        """Read-modify-write one category file under the tenant's locks (in-process and on disk)."""
        lock = self._locks.setdefault(tenant, asyncio.Lock())
        async with lock:
            return await asyncio.to_thread(self._change_locked, tenant, category, change)

    def _change_locked(self, tenant: str, category: Category, change) -> bool:  # type: ignore[no-untyped-def]
        folder = self._dir(tenant)
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".lock")):
            entries = self._read(tenant, category)
            changed = change(entries)
            if changed:
                data = orjson.dumps([e.model_dump(mode="json") for e in entries.values()])
                write_atomically(self._file(tenant, category), data)
        return changed

    async def put(self, entry: MemoryEntry) -> None:
        old = await self.get(entry.tenant, entry.id)
        if old is not None and old.category != entry.category:
            await self.delete(entry.tenant, entry.id)

        def upsert(entries: dict[str, MemoryEntry]) -> bool:
            entries[entry.id] = entry
            return True

        await self._change(entry.tenant, entry.category, upsert)

    async def get(self, tenant: str, entry_id: str) -> MemoryEntry | None:
        return self._view(tenant).entries.get(entry_id)

    async def delete(self, tenant: str, entry_id: str) -> bool:
        entry = await self.get(tenant, entry_id)
        if entry is None:
            return False
        return await self._change(tenant, entry.category, lambda entries: entries.pop(entry_id, None) is not None)

    async def list(self, tenant: str, category: Category | None = None,
                   now: float | None = None) -> builtins.list[MemoryEntry]:
        entries = self._view(tenant).entries.values()
        return sorted((e for e in entries if (category is None or e.category == category)
                       and (now is None or not e.expired(now))), key=lambda e: (e.created_at, e.id))

    async def search(self, tenant: str, query: str, categories: tuple[Category, ...], user: str | None,
                     project: str | None, limit: int, now: float) -> builtins.list[tuple[MemoryEntry, float]]:
        return self._view(tenant).search(query, categories, user, project, limit, now)

    async def version(self, tenant: str) -> int:
        return self._version(tenant)

    async def purge_expired(self, tenant: str, now: float) -> int:
        expired = {e.category for e in self._view(tenant).entries.values() if e.expired(now)}
        removed = 0
        for category in expired:
            def purge(entries: dict[str, MemoryEntry]) -> bool:
                nonlocal removed
                gone = [k for k, e in entries.items() if e.expired(now)]
                for k in gone:
                    del entries[k]
                removed += len(gone)
                return bool(gone)

            await self._change(tenant, category, purge)
        return removed

    async def close(self) -> None:
        return None
