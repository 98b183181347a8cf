"""WAL settings (`ctxgate.wal` in the config file).

Where the log lives (`backend`): `redis` whenever `ctxgate.state` is a Redis URL, `file`
otherwise. With Redis state the replicas share each session, so its log belongs beside it
in Redis, not in one replica's data directory; with in-process state the files are what a
restarted gateway rebuilds from. Either can be chosen explicitly; `redis` with
`state: memory` needs `wal.redis_url`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ctxgate.redis_backend import RedisTarget, is_redis_url


class WalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = None
    """None: by profile. The minimal profile runs without a WAL."""
    backend: Literal["file", "redis"] | None = None
    """None: `redis` when `ctxgate.state` is a Redis URL, `file` otherwise."""
    redis_url: str | None = None
    """The Redis of the log; None: the one of `ctxgate.state`."""
    redis_wait_replicas: int = Field(default=0, ge=0)
    """Redis backend: after each append, `WAIT` for this many replicas to acknowledge it, and
    refuse the turn (503) when fewer did in `redis_wait_timeout_ms`. 0: no WAIT."""
    redis_wait_timeout_ms: int = Field(default=1000, gt=0)
    redis_idle_ttl_days: float | None = Field(default=None, gt=0)
    """Redis backend: a log not appended to for this long is removed by Redis (its stream,
    checkpoints and records), as Redis state expires. None: kept, as files are."""
    sqlite: bool | None = None
    """Mirror events into SQLite for `ctxgate stats`. None: on for the enterprise profile."""
    checkpoint_every: int = Field(default=100, gt=0)
    """A CHECKPOINT after this many events (professional: 100), and after every compaction."""
    archive_every: int = Field(default=10, gt=0)
    """Every this many checkpoints, the events before the latest one move to the archive."""
    archive_retention_days: float = Field(default=7.0, gt=0)
    recover_on_start: int = Field(default=256, ge=0)
    """At start, rebuild this many sessions (the most recently written logs) in the background;
    any other is rebuilt when it is first seen."""
    store_content: bool = False
    """Keep user content in USER_INPUT events; by default only its hash is kept."""
    idempotency_ttl_s: float = Field(default=24 * 3600.0, gt=0)
    idempotency_max_per_tenant: int = Field(default=1000, gt=0)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None:
            RedisTarget.parse(v)  # raises a ValueError naming the URL, password masked
        return v

    def enabled_for(self, profile: str) -> bool:
        return self.enabled if self.enabled is not None else profile != "minimal"

    def sqlite_for(self, profile: str) -> bool:
        return self.sqlite if self.sqlite is not None else profile == "enterprise"

    def backend_for(self, state: str) -> Literal["file", "redis"]:
        """The rule of the module docstring, for `ctxgate.state` = `state`."""
        if self.backend is not None:
            return self.backend
        return "redis" if is_redis_url(state) else "file"

    def redis_url_for(self, state: str) -> str:
        url = self.redis_url or (state if is_redis_url(state) else None)
        if url is None:
            raise ValueError("wal.backend: redis needs wal.redis_url when ctxgate.state is not a Redis URL")
        return url
