"""Enterprise: WAL events mirrored into SQLite for queries (`ctxgate stats`).

The log (files or Redis) stays the source of truth and the request path only puts events
on a queue; one background thread writes them in batches. With the Redis backend each
gateway mirrors the events it appended into its own file; `ctxgate stats --import` fills
one mirror with every replica's events from Redis. Rows are keyed by (tenant, session,
seq) and inserted with OR IGNORE, so a catch-up import from the files after a crash is
idempotent.
"""
from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .events import EventType
from .backend import WalLog
from .file_log import FileLog
from .paths import WalPaths

log = logging.getLogger("ctxgate.wal.mirror")
DB_NAME = "wal.sqlite"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
  tenant TEXT NOT NULL, session TEXT NOT NULL, seq INTEGER NOT NULL, type TEXT NOT NULL,
  ts TEXT NOT NULL, day TEXT NOT NULL, level TEXT, tokens_in INTEGER, tokens_out INTEGER, data TEXT NOT NULL,
  PRIMARY KEY (tenant, session, seq));
CREATE INDEX IF NOT EXISTS events_by_day ON events (type, tenant, day);
"""
_INSERT = "INSERT OR IGNORE INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
_DELETE = "DELETE FROM events WHERE tenant = ? AND session = ?"
_STOP = None


def connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=30, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(_SCHEMA)
    return db


def _row(tenant: str, session: str, event: dict[str, Any]) -> tuple[Any, ...]:
    ts = str(event.get("timestamp", ""))
    compression = event["type"] == EventType.COMPRESSION.value
    data = {k: v for k, v in event.items() if k != "state"}  # snapshots stay in the JSONL
    return (tenant, session, event["seq"], event["type"], ts, ts[:10],
            event.get("level") if compression else None,
            event.get("input_tokens") if compression else None,
            event.get("output_tokens") if compression else None, orjson.dumps(data).decode())


@dataclass
class _Erase:
    """A session's rows to delete, in order with the inserts queued before it."""
    tenant: str
    session: str
    done: threading.Event = field(default_factory=threading.Event)
    removed: int = 0


_Item = tuple[str, str, list[dict[str, Any]]] | _Erase | None


class SqliteMirror:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def put(self, tenant: str, session: str, events: list[dict[str, Any]]) -> None:
        if self._thread is None:
            self._start()
        self._queue.put((tenant, session, events))

    def erase(self, tenant: str, session: str) -> int:
        """Delete the session's rows (blocking until done); how many. Through the writer thread
        when it runs, so rows still queued for the session are written first, then deleted."""
        if self._thread is None:
            if not self.path.exists():
                return 0
            db = connect(self.path)
            try:
                with db:
                    return db.execute(_DELETE, (tenant, session)).rowcount
            finally:
                db.close()
        request = _Erase(tenant, session)
        self._queue.put(request)
        request.done.wait()
        return request.removed

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._thread = threading.Thread(target=self._run, name="wal-sqlite", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        db = connect(self.path)
        try:
            while True:
                item = self._queue.get()
                batch = [item]
                while not self._queue.empty() and len(batch) < 1000:
                    batch.append(self._queue.get())
                rows: list[tuple[Any, ...]] = []
                for entry in batch:
                    if isinstance(entry, _Erase):
                        _write(db, rows)
                        rows = []
                        try:
                            with db:
                                entry.removed = db.execute(_DELETE, (entry.tenant, entry.session)).rowcount
                        except sqlite3.Error as e:
                            log.warning("SQLite mirror: rows of %s/%s not deleted: %s", entry.tenant, entry.session, e)
                        entry.done.set()
                    elif entry is not None:
                        tenant, session, events = entry
                        rows += [_row(tenant, session, e) for e in events]
                _write(db, rows)
                if _STOP in batch:
                    return
        finally:
            db.close()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=30)
            self._thread = None


def _write(db: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
    if not rows:
        return
    try:
        with db:
            db.executemany(_INSERT, rows)
    except sqlite3.Error as e:  # the log has them; `ctxgate stats --import` catches up
        log.warning("SQLite mirror: %d events not written: %s", len(rows), e)


def import_logs(db_path: Path, log: WalLog) -> int:
    """Copy every event of every log (archives included) not yet in the database."""
    db = connect(db_path)
    before = db.total_changes
    try:
        with db:
            for info in log.sessions():
                for scan in log.history(info.tenant, info.session).scans:
                    db.executemany(_INSERT, (_row(info.tenant, info.session, e) for e in scan.events))
        return db.total_changes - before
    finally:
        db.close()


def import_files(db_path: Path, paths: WalPaths) -> int:
    log = FileLog(paths)
    try:
        return import_logs(db_path, log)
    finally:
        log.close()


def compression_stats(db_path: Path, tenant: str | None = None, since: str | None = None) -> list[dict[str, Any]]:
    """Compressions and tokens saved per tenant, day and level."""
    db = connect(db_path)
    try:
        where, args = ["type = 'COMPRESSION'"], []
        if tenant:
            where.append("tenant = ?")
            args.append(tenant)
        if since:
            where.append("day >= ?")
            args.append(since)
        rows = db.execute(
            "SELECT tenant, day, level, COUNT(*), SUM(MAX(0, COALESCE(tokens_in, 0) - COALESCE(tokens_out, 0))) "
            f"FROM events WHERE {' AND '.join(where)} GROUP BY tenant, day, level ORDER BY tenant, day, level",
            args).fetchall()
    finally:
        db.close()
    return [{"tenant": t, "day": d, "level": lv, "compressions": n, "tokens_saved": saved or 0}
            for t, d, lv, n, saved in rows]
