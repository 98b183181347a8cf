"""Where a session's log is kept: files (`file_log.py`) or Redis streams (`redis_log.py`).

The journal appends, reads back, archives and rolls back through this interface only, so
recovery, checkpoints and the CLI are the same code on both. Ids are the proxy's; each
backend names its files or keys from them safely.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .reader import WalScan


class WalUnavailable(OSError):
    """The log could not take an append (its store is unreachable, or too few replicas
    acknowledged it): the turn is refused before anything is forwarded (a new conversation
    logged beside its upstream call is answered, and the tenant's turns after it refused)."""


class WalFenced(WalUnavailable):
    """The append's fence did not hold: the writer's lease on the session lapsed, and the log
    took nothing."""


@dataclass(frozen=True)
class Fence:
    """Append only while the key `key` on the Redis at `where` holds `token` (a lease on the
    session): checked in the same script as the append, so a writer whose lease lapsed writes
    nothing. A log elsewhere (files, another Redis) cannot check it and ignores it."""
    where: str
    key: str
    token: bytes


@dataclass
class Appended:
    events: list[dict[str, Any]]
    archived: str | Path | None = None

    @property
    def last_seq(self) -> int:
        return self.events[-1]["seq"] if self.events else 0


@dataclass
class LogRead:
    """A session's log as read back: enough to recover from it or roll it back."""
    scans: list[WalScan]
    """Oldest first, the live log last."""
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every compaction record held in full by what was read, by `records.record_key`."""
    held: set[str] = field(default_factory=set)
    """The records the live log holds: what its next checkpoint may name instead of writing."""


@dataclass
class Erased:
    """What erasing a session's log removed: its live log (0 or 1) and its archive segments."""
    live: int = 0
    archives: int = 0


@dataclass
class LogInfo:
    tenant: str
    session: str
    where: str
    written_at: float


class WalLog(Protocol):
    where: str
    """What the CLI names as the place of the logs."""

    def exists(self, tenant: str, session: str) -> bool:
        """Is there a live log? (Archives alone are history, not a session to resume.)"""

    def open(self, tenant: str, session: str) -> LogRead:
        """Recovery's read: the live log (repaired, for files), and the archives before it only
        when it holds no checkpoint with a state."""

    def live(self, tenant: str, session: str) -> WalScan:
        """The live log alone, read without changing anything."""

    def history(self, tenant: str, session: str) -> LogRead:
        """Archives and the live log, read without changing anything: rollback and the CLI."""

    def append(self, tenant: str, session: str, events: list[dict[str, Any]], after_seq: int = 0,
               sync: bool = False, fence: Fence | None = None) -> Appended:
        """Write `events` ({"type": ..., fields}) with seqs after max(`after_seq`, the log's last);
        `sync`: durable before returning; `fence`: only while it holds (`WalFenced` when not).
        Raises OSError (`WalUnavailable`) when it cannot."""

    def checks(self, fence: Fence) -> bool:
        """Whether `append` checks `fence` itself (the log is in the Redis that holds its key)."""
        ...

    def ping(self) -> bool:
        """Can the log be written now (its Redis answers; a file log: always)?"""
        ...

    def version(self, tenant: str, session: str) -> tuple[Any, ...]:
        """Changes whenever the session's log does, known without reading it (file sizes and
        times; a stream's last entry): what a reader caches its reading by."""
        ...

    def sessions(self, tenant: str | None = None) -> list[LogInfo]:
        ...

    def changed_externally(self, tenant: str, session: str) -> bool:
        """Did something else (a rollback from the CLI) write the log since this one did?"""

    def archive(self, tenant: str, session: str) -> str | None:
        """Archive everything before the latest checkpoint (the CLI's `wal archive`)."""

    def prune(self, retention_s: float, now: float) -> list[str]:
        """Remove archives older than `retention_s`; what was removed."""

    def erase(self, tenant: str, session: str) -> Erased:
        """Remove the session's live log and every archive of it (deleting a session's data)."""
        ...

    def close(self) -> None:
        ...
