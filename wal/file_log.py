"""The log in files (docs/wal.md, Files): `WalWriter` appends, `reader` reads back,
`archive` moves old events to `wal_archive/`."""
from __future__ import annotations

import os

import time
from pathlib import Path
from typing import Any, Callable

from .archive import archive_segment, prune_archives, remove
from .backend import Appended, Erased, Fence, LogInfo, LogRead
from .events import EventType
from .paths import WalPaths
from .reader import WalScan, scan_file
from .records import full_records
from .writer import WalWriter, flocked


class FileLog:
    def __init__(self, paths: WalPaths, archive_every: int = 10, retention_s: float = 7 * 86400.0,
                 clock: Callable[[], float] = time.time,
                 on_torn: Callable[[Path, bytes], None] | None = None) -> None:
        self.paths = paths
        self.where = str(paths.live_root)
        self.writer = WalWriter(paths, archive_every, retention_s, clock, on_torn=on_torn)

    def exists(self, tenant: str, session: str) -> bool:
        return self.paths.live(tenant, session).exists()

    def open(self, tenant: str, session: str) -> LogRead:
        live = self.writer.open(tenant, session)  # sets a torn last line aside
        scans = [live]
        if not any(isinstance(c.get("state"), dict) for c in live.checkpoints):
            scans = [scan_file(p) for p in self.paths.archives(tenant, session)] + [live]
        return _read(scans)

    def live(self, tenant: str, session: str) -> WalScan:
        return scan_file(self.paths.live(tenant, session))

    def history(self, tenant: str, session: str) -> LogRead:
        files = [*self.paths.archives(tenant, session), self.paths.live(tenant, session)]
        return _read([scan_file(f) for f in files])

    def checks(self, fence: Fence) -> bool:
        """A file cannot check a fence: a replica's files are its own."""
        return False

    def append(self, tenant: str, session: str, events: list[dict[str, Any]], after_seq: int = 0,
               sync: bool = False, fence: Fence | None = None) -> Appended:
        """`fence` is not checked here (`checks`)."""
        return self.writer.append(tenant, session, events, after_seq, sync)

    def version(self, tenant: str, session: str) -> tuple[Any, ...]:
        return tuple(_signature(f) for f in [*self.paths.archives(tenant, session), self.paths.live(tenant, session)])

    def sessions(self, tenant: str | None = None) -> list[LogInfo]:
        return [LogInfo(t, s, str(f), _mtime(f)) for t, s, f in self.paths.sessions(tenant)]

    def changed_externally(self, tenant: str, session: str) -> bool:
        return self.writer.changed_externally(tenant, session)

    def archive(self, tenant: str, session: str) -> str | None:
        live = self.paths.live(tenant, session)
        with open(live, "ab") as fh, flocked(fh):  # the gateway's appends wait meanwhile
            at = _latest_checkpoint_offset(scan_file(live))
            segment = archive_segment(live, self.paths.archive_dir(tenant), at) if at else None
        return str(segment) if segment is not None else None

    def prune(self, retention_s: float, now: float) -> list[str]:
        return [str(p) for p in prune_archives(self.paths.archive_root, retention_s, now)]

    def erase(self, tenant: str, session: str) -> Erased:
        live = self.paths.live(tenant, session)
        self.writer.forget(tenant, session)
        erased = Erased(live=int(remove(live)))
        remove(live.with_name(live.name + ".torn"))  # a torn fragment holds the session's text too
        erased.archives = sum(remove(p) for p in self.paths.archives(tenant, session))
        return erased

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        self.writer.close()


def _read(scans: list[WalScan]) -> LogRead:
    """Each file's first checkpoint holds its records in full, so the records of the files read
    resolve every name their checkpoints use."""
    return LogRead(scans, full_records(e for scan in scans for e in scan.events), set(full_records(scans[-1].events)))


def _latest_checkpoint_offset(scan: WalScan) -> int:
    """Where the last checkpoint line starts (0: none, or it is the first line already)."""
    for event, offset in zip(reversed(scan.events), reversed(scan.offsets)):
        if event["type"] == EventType.CHECKPOINT.value and isinstance(event.get("state"), dict):
            return offset
    return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _signature(path: Path) -> tuple[str, int, int]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (str(path), -1, -1)
    return (str(path), st.st_size, st.st_mtime_ns)
