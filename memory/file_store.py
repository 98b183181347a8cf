"""The default long-term store: one append-only log per tenant and category,
`<data_dir>/memory/<tenant>/<category>.jsonl`, one change per line (`{"put": entry}` or
`{"del": id}`).

A write appends its lines and fsyncs them under a `filelock` lock per tenant, so two
processes sharing the directory never lose each other's writes, and costs what it writes,
not the size of the memory. When the log holds more dead lines than live entries it is
compacted (the live entries rewritten atomically). Every process keeps each log as parsed
so far and reads only what was appended since (a compaction, a new inode, is read whole).
File work and the view rebuild run in a thread, off the event loop. A `<category>.json`
of earlier versions (the whole category as one list) is read as the log's start and
removed by the first compaction.
"""
from __future__ import annotations

import asyncio
import builtins
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import orjson
import xxhash
from filelock import FileLock
from pydantic import TypeAdapter

from ctxgate.wal.archive import write_atomically
from ctxgate.wal.paths import safe_name
from .entries import Category, MemoryEntry
from .ranking import TenantView

log = logging.getLogger("ctxgate.memory")
_LEGACY = TypeAdapter(list[MemoryEntry])
_MIN_DEAD_LINES = 64
"""A log is compacted once its dead lines exceed both this and its live entries."""

Op = tuple[str, MemoryEntry | str]
"""("put", entry) or ("del", entry id)."""
_STAMPED = frozenset(name for c in Category for name in (f"{c.value}.jsonl", f"{c.value}.json"))
"""The names of a tenant's memory files (and those of the format before, still read)."""


@dataclass
class _Log:
    """One category log as this process has read it."""
    inode: int = -1
    offset: int = 0
    lines: int = 0
    entries: dict[str, MemoryEntry] = field(default_factory=dict)


def _apply(entries: dict[str, MemoryEntry], op: Op) -> None:
    kind, what = op
    if kind == "put" and isinstance(what, MemoryEntry):
        entries[what.id] = what
    elif isinstance(what, str):
        entries.pop(what, None)


def _line(op: Op) -> bytes:
    kind, what = op
    value = what.model_dump(mode="json") if isinstance(what, MemoryEntry) else what
    return orjson.dumps({kind: value}) + b"\n"


def _parse(line: bytes) -> Op | None:
    doc = orjson.loads(line)
    if not isinstance(doc, dict):
        return None
    if "put" in doc:
        return "put", MemoryEntry.model_validate(doc["put"])
    if isinstance(doc.get("del"), str):
        return "del", doc["del"]
    return None


class FileMemoryStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._views: dict[str, TenantView] = {}
        self._logs: dict[tuple[str, Category], _Log] = {}
        self._tenant_locks: dict[str, asyncio.Lock] = {}
        self._files_lock = threading.Lock()
        """Worker threads share the parsed logs: one at a time reads or writes them."""

    def _dir(self, tenant: str) -> Path:
        return self.root / safe_name(tenant)

    def _file(self, tenant: str, category: Category) -> Path:
        return self._dir(tenant) / f"{category.value}.jsonl"

    def _legacy(self, tenant: str, category: Category) -> Path:
        return self._dir(tenant) / f"{category.value}.json"

    def _version(self, tenant: str) -> int:
        """The files' inodes, mtimes and sizes, hashed: the same in every process sharing the
        directory. Asked every turn: one listing of the tenant's folder and a stat of each file
        it holds (none for a tenant without memory), not a stat of every name a file could have."""
        stamp = []
        try:
            with os.scandir(self._dir(tenant)) as found:
                for entry in found:
                    if entry.name in _STAMPED:
                        try:
                            st = entry.stat()
                        except FileNotFoundError:  # removed since the listing
                            continue
                        stamp.append(f"{entry.name}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}")
        except (FileNotFoundError, NotADirectoryError):
            return 0
        stamp.sort()  # a listing's order is the file system's
        return xxhash.xxh64_intdigest("|".join(stamp).encode()) if stamp else 0

    def _read(self, tenant: str, category: Category) -> _Log:
        """The category log, reading only what was appended since the last read."""
        key = (tenant, category)
        path = self._file(tenant, category)
        current = self._logs.get(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if current is None or current.inode != st.st_ino or st.st_size < current.offset:
                    current = _Log(inode=st.st_ino, entries=self._legacy_entries(tenant, category))
                f.seek(current.offset)
                tail = f.read()
        except FileNotFoundError:
            current = self._logs[key] = _Log(inode=0, entries=self._legacy_entries(tenant, category))
            return current
        complete = tail[:tail.rfind(b"\n") + 1]  # a line still being written is read next time
        for number, line in enumerate(complete.splitlines(), current.lines + 1):
            try:
                op = _parse(line)
            except ValueError as e:  # a line torn by a crash: reported, skipped
                log.warning("memory log %s line %d unreadable (%s): skipped", path, number, e)
                continue
            if op is not None:
                _apply(current.entries, op)
        current.offset += len(complete)
        current.lines += complete.count(b"\n")
        self._logs[key] = current
        return current

    def _legacy_entries(self, tenant: str, category: Category) -> dict[str, MemoryEntry]:
        try:
            raw = self._legacy(tenant, category).read_bytes()
        except FileNotFoundError:
            return {}
        return {e.id: e for e in _LEGACY.validate_json(raw)}

    def _view_now(self, tenant: str) -> TenantView:
        with self._files_lock:
            version = self._version(tenant)
            view = self._views.get(tenant)
            if view is None or view.version != version:
                entries = [e for c in Category for e in self._read(tenant, c).entries.values()]
                view = self._views[tenant] = TenantView(version, entries)
            return view

    async def _view(self, tenant: str) -> TenantView:
        view = self._views.get(tenant)
        if view is not None and view.version == self._version(tenant):
            return view
        return await asyncio.to_thread(self._view_now, tenant)

    async def _change(self, tenant: str, category: Category,
                      change: Callable[[dict[str, MemoryEntry]], list[Op]]) -> int:
        """Append the ops `change` makes of the category's current entries, under the tenant's
        locks (in-process and on disk); returns how many it made."""
        lock = self._tenant_locks.setdefault(tenant, asyncio.Lock())
        async with lock:
            return await asyncio.to_thread(self._change_now, tenant, category, change)

    def _change_now(self, tenant: str, category: Category,
                    change: Callable[[dict[str, MemoryEntry]], list[Op]]) -> int:
        folder = self._dir(tenant)
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".lock")), self._files_lock:
            current = self._read(tenant, category)
            ops = change(current.entries)
            if not ops:
                return 0
            path = self._file(tenant, category)
            with open(path, "ab") as f:
                if f.tell() > current.offset:  # a torn last line: the new lines start on their own
                    f.write(b"\n")
                f.write(b"".join(_line(op) for op in ops))
                f.flush()
                os.fsync(f.fileno())
            self._read(tenant, category)
            if current.lines - len(current.entries) > max(_MIN_DEAD_LINES, len(current.entries)):
                self._compact(tenant, category, current)
            return len(ops)

    def _compact(self, tenant: str, category: Category, current: _Log) -> None:
        data = b"".join(_line(("put", e)) for e in current.entries.values())
        write_atomically(self._file(tenant, category), data)
        self._legacy(tenant, category).unlink(missing_ok=True)
        self._logs.pop((tenant, category), None)
        self._read(tenant, category)

    async def put(self, entry: MemoryEntry) -> None:
        old = await self.get(entry.tenant, entry.id)
        if old is not None and old.category != entry.category:
            await self.delete(entry.tenant, entry.id)
        await self._change(entry.tenant, entry.category, lambda _: [("put", entry)])

    async def get(self, tenant: str, entry_id: str) -> MemoryEntry | None:
        return (await self._view(tenant)).entries.get(entry_id)

    async def delete(self, tenant: str, entry_id: str) -> bool:
        entry = await self.get(tenant, entry_id)
        if entry is None:
            return False
        return bool(await self._change(tenant, entry.category,
                                       lambda entries: [("del", entry_id)] if entry_id in entries else []))

    async def list(self, tenant: str, category: Category | None = None,
                   now: float | None = None) -> builtins.list[MemoryEntry]:
        entries = (await self._view(tenant)).entries.values()
        return sorted((e for e in entries if (category is None or e.category == category)
                       and (now is None or not e.expired(now))), key=lambda e: (e.created_at, e.id))

    async def search(self, tenant: str, query: str, categories: tuple[Category, ...], user: str | None,
                     project: str | None, limit: int, now: float) -> builtins.list[tuple[MemoryEntry, float]]:
        return (await self._view(tenant)).search(query, categories, user, project, limit, now)

    async def version(self, tenant: str) -> int:
        return self._version(tenant)

    async def purge_expired(self, tenant: str, now: float) -> int:
        expired = {e.category for e in (await self._view(tenant)).entries.values() if e.expired(now)}
        removed = 0
        for category in expired:
            removed += await self._change(tenant, category, lambda entries: [
                ("del", k) for k, e in entries.items() if e.expired(now)])
        return removed

    async def close(self) -> None:
        return None
