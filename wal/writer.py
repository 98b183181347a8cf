"""Appending events: one file per session, opened in append mode, flushed per event.

Every append holds an exclusive `flock` on the file, so `ctxgate wal rollback` and
`wal archive` run safely next to a live gateway; a file replaced meanwhile (archived,
rolled back) is noticed by its inode and reopened. Sequence numbers come from the caller
(the session state, shared by replicas) and from the file itself, whichever is higher,
so a seq is never reused.
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from .archive import archive_segment, prune_archives
from .backend import Appended
from .events import EventType, encode_line, timestamp
from .paths import WalPaths
from .reader import WalScan, scan_bytes

log = logging.getLogger("ctxgate.wal")
Clock = Callable[[], float]


@dataclass
class _LiveFile:
    path: Path
    fh: BinaryIO
    inode: int
    size: int
    last_seq: int
    checkpoints: int
    guard: threading.Lock = field(default_factory=threading.Lock)


@contextmanager
def flocked(fh: BinaryIO) -> Iterator[None]:
    fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


class WalWriter:
    def __init__(self, paths: WalPaths, archive_every: int = 10, retention_s: float = 7 * 86400.0,
                 clock: Clock = time.time, max_open: int = 512,
                 on_torn: Callable[[Path, bytes], None] | None = None) -> None:
        self.paths = paths
        self._archive_every = archive_every
        self._retention_s = retention_s
        self._clock = clock
        self._max_open = max_open
        self._on_torn = on_torn
        self._files: OrderedDict[tuple[str, str], _LiveFile] = OrderedDict()
        self._lock = threading.Lock()  # guards the open-file cache only; appends hold the file's own guard

    def open(self, tenant: str, session: str) -> WalScan:
        """Open the session's file for appending (setting a torn last line aside) and
        return what it holds: recovery reads the same scan."""
        with self._lock:
            self._close_one(tenant, session)
            lf, scan = self._open(tenant, session)
            self._files[(tenant, session)] = lf
            self._evict()
        return scan

    def append(self, tenant: str, session: str, events: list[dict[str, Any]], after_seq: int = 0,
               sync: bool = False) -> Appended:
        """Write `events` ({"type": ..., fields}) with seq after max(`after_seq`, the file's last)."""
        if not events:
            return Appended([])
        key = (tenant, session)
        with self._lock:
            lf = self._files.get(key)
            if lf is None:
                lf, _ = self._open(tenant, session)
                self._files[key] = lf
                self._evict()
            self._files.move_to_end(key)
        with lf.guard:  # one file, one writer; other sessions (and their fsyncs) go on meanwhile
            lf = self._current(key, lf)
            with flocked(lf.fh):
                self._catch_up(lf)
                written, data, checkpoint_at = [], bytearray(), None
                seq = max(after_seq, lf.last_seq)
                now = timestamp(self._clock())
                for event in events:
                    seq += 1
                    full = {"seq": seq, "type": event["type"], "timestamp": now,
                            **{k: v for k, v in event.items() if k != "type"}}
                    if full["type"] == EventType.CHECKPOINT.value:
                        checkpoint_at = lf.size + len(data)
                        lf.checkpoints += 1
                    data += encode_line(full)
                    written.append(full)
                lf.fh.write(data)
                lf.fh.flush()
                if sync:
                    os.fsync(lf.fh.fileno())
                lf.size += len(data)
                lf.last_seq = seq
                archived = None
                if checkpoint_at is not None and lf.checkpoints > self._archive_every:
                    archived = archive_segment(lf.path, self.paths.archive_dir(tenant), checkpoint_at, self._clock())
        if archived is not None:
            with self._lock:
                self._close_one(tenant, session)
            prune_archives(self.paths.archive_root, self._retention_s, self._clock())
        return Appended(written, archived)

    @staticmethod
    def _catch_up(lf: _LiveFile) -> None:
        """Another process (a worker of the same gateway) appended since this one last wrote:
        take the file's size, last seq and checkpoint count from the file itself, or an archive
        pass would split the log at a stale offset, mid-line. Call with the file locked."""
        size = os.fstat(lf.fh.fileno()).st_size
        if size == lf.size:
            return
        with open(lf.path, "rb") as rd:
            scan = scan_bytes(lf.path, rd.read())
        lf.size, lf.last_seq, lf.checkpoints = size, max(lf.last_seq, scan.last_seq), len(scan.checkpoints)

    def changed_externally(self, tenant: str, session: str) -> bool:
        """Did something else (a rollback from the CLI) write the file since this writer did?"""
        lf = self._files.get((tenant, session))
        if lf is None:
            return False
        try:
            st = lf.path.stat()
        except FileNotFoundError:
            return True
        return st.st_ino != lf.inode or st.st_size != lf.size

    def _current(self, key: tuple[str, str], lf: _LiveFile) -> _LiveFile:
        """The file as it is on disk now: one replaced by an archive pass or a rollback is reopened."""
        try:
            if lf.path.stat().st_ino == lf.inode and not lf.fh.closed:
                return lf
        except FileNotFoundError:
            pass
        lf.fh.close()
        fresh, _ = self._open(*key)
        fresh.guard = lf.guard
        with self._lock:
            self._files[key] = fresh
        return fresh

    def _open(self, tenant: str, session: str) -> tuple[_LiveFile, WalScan]:
        path = self.paths.live(tenant, session)
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "ab")
        with flocked(fh):
            with open(path, "rb") as rd:
                scan = scan_bytes(path, rd.read())
            if scan.torn:
                self._set_aside(path, scan)
            st = os.fstat(fh.fileno())
        return _LiveFile(path, fh, st.st_ino, st.st_size, scan.last_seq, len(scan.checkpoints)), scan

    def _set_aside(self, path: Path, scan: WalScan) -> None:
        """A crash cut the last write short: keep the fragment next to the log, drop it from the log."""
        with open(path.with_name(path.name + ".torn"), "ab") as side:
            side.write(scan.torn + b"\n")
        os.truncate(path, scan.good_length)
        log.warning("WAL %s: a torn last line (%d bytes) was set aside in %s.torn", path, len(scan.torn), path.name)
        if self._on_torn is not None:
            self._on_torn(path, scan.torn)

    def forget(self, tenant: str, session: str) -> None:
        """Close the session's file (its log is being erased): a later append opens it anew."""
        with self._lock:
            lf = self._files.pop((tenant, session), None)
        if lf is not None:
            with lf.guard:
                lf.fh.close()

    def _close_one(self, tenant: str, session: str) -> None:
        lf = self._files.pop((tenant, session), None)
        if lf is not None:
            lf.fh.close()

    def _evict(self) -> None:
        """Close the least recently used files past `max_open`, never one being written."""
        for key in list(islice(self._files, max(0, len(self._files) - self._max_open))):
            lf = self._files[key]
            if lf.guard.acquire(blocking=False):
                try:
                    del self._files[key]
                    lf.fh.close()
                finally:
                    lf.guard.release()

    def close(self) -> None:
        with self._lock:
            for lf in self._files.values():
                lf.fh.close()
            self._files.clear()
