"""Where a session's log is kept: files (`file_log.py`) or Redis streams (`redis_log.py`).

The journal appends, reads back, archives and rolls back through this interface only, so
recovery, checkpoints and the CLI are the same code on both. Ids are the proxy's; each
backend names its files or keys from them safely.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from .config import WalConfig
from .paths import WalPaths
from .reader import WalScan


class WalUnavailable(OSError):
    """The log could not take an append (its store is unreachable, or too few replicas
    acknowledged it): the turn is refused before anything is forwarded."""


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
               sync: bool = False) -> Appended:
        """Write `events` ({"type": ..., fields}) with seqs after max(`after_seq`, the log's last);
        `sync`: durable before returning. Raises OSError (`WalUnavailable`) when it cannot."""

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

    def close(self) -> None:
        ...


def open_log(config: WalConfig, paths: WalPaths, state: str, clock: Callable[[], float],
             on_torn: Callable[[Path, bytes], None] | None = None) -> WalLog:
    """The backend `config` names for `ctxgate.state` = `state` (`WalConfig.backend_for`)."""
    retention_s = config.archive_retention_days * 86400.0
    if config.backend_for(state) == "redis":
        from .redis_log import RedisLog  # redis is imported only when a log lives there

        return RedisLog(config.redis_url_for(state), config.archive_every, retention_s, clock,
                        config.redis_wait_replicas, config.redis_wait_timeout_ms,
                        config.redis_idle_ttl_days * 86400.0 if config.redis_idle_ttl_days else None)
    from .file_log import FileLog

    return FileLog(paths, config.archive_every, retention_s, clock, on_torn)
