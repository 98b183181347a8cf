"""What compaction cut, kept in files beside the WAL when the session state is in-process.

In-process state is a cache of what the WAL holds (a restart rebuilds it from the log), so
the originals a session's notes name must outlive the process too: a session that carries
on after a restart asks for the same references and is served the same bytes. One file per
original, `<data_dir>/content/<tenant>/<session>/<ref>`, written atomically; its age is its
modification time. Reads and writes run in a worker thread, off the event loop.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from ctxgate.wal.archive import write_atomically
from ctxgate.wal.paths import safe_name


class FileContentStore:
    def __init__(self, data_dir: str | Path) -> None:
        self.root = Path(data_dir) / "content"

    def _dir(self, tenant: str, session_id: str) -> Path:
        return self.root / safe_name(tenant) / safe_name(session_id)

    async def put(self, tenant: str, session_id: str, originals: dict[str, str], max_bytes: int,
                  ttl_s: float) -> None:
        if originals:
            await asyncio.to_thread(self._put, self._dir(tenant, session_id), originals, max_bytes, ttl_s)

    @staticmethod
    def _put(folder: Path, originals: dict[str, str], max_bytes: int, ttl_s: float) -> None:
        for ref, text in originals.items():
            folder.mkdir(parents=True, exist_ok=True)  # per write: housekeeping may remove an emptied folder
            write_atomically(folder / safe_name(ref), text.encode())
        kept = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in folder.iterdir() if p.is_file()),
                      key=lambda entry: entry[0])
        total, oldest_kept = sum(size for _, size, _ in kept), time.time() - ttl_s
        for mtime, size, path in kept:  # the oldest go first: past their age, or past the size
            if total <= max_bytes and mtime >= oldest_kept:
                break
            path.unlink(missing_ok=True)
            total -= size

    async def get(self, tenant: str, session_id: str, ref: str, ttl_s: float) -> str | None:
        return await asyncio.to_thread(self._get, self._dir(tenant, session_id) / safe_name(ref), ttl_s)

    @staticmethod
    def _get(path: Path, ttl_s: float) -> str | None:
        try:
            if os.stat(path).st_mtime < time.time() - ttl_s:
                return None
            return path.read_bytes().decode()
        except FileNotFoundError:
            return None

    async def prune(self, ttl_s: float) -> int:
        return await asyncio.to_thread(self._prune, time.time() - ttl_s)

    def _prune(self, oldest_kept: float) -> int:
        removed = 0
        for folder in self.root.glob("*/*"):
            for path in folder.iterdir():
                if path.is_file() and path.stat().st_mtime < oldest_kept:
                    path.unlink(missing_ok=True)
                    removed += 1
            if not any(folder.iterdir()):
                try:
                    folder.rmdir()  # a session whose originals are all gone leaves no folder behind
                except OSError:
                    pass  # written to meanwhile: kept
        return removed

    async def erase(self, tenant: str, session_id: str) -> int:
        return await asyncio.to_thread(_remove_folder, self._dir(tenant, session_id))

    async def close(self) -> None:
        return None


def _remove_folder(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    removed = 0
    for path in folder.iterdir():
        path.unlink(missing_ok=True)
        removed += 1
    folder.rmdir()
    return removed
