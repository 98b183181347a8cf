"""Opening the log `ctxgate.wal` names: files (`file_log.py`) or Redis streams
(`redis_log.py`). Apart from `backend.py`, which both logs implement, so neither imports
the module that chooses between them."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from .backend import WalLog
from .config import WalConfig
from .paths import WalPaths


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
