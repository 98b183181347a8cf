"""WAL settings (`ctxgate.wal` in the config file)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = None
    """None: by profile. The minimal profile runs without a WAL."""
    sqlite: bool | None = None
    """Mirror events into SQLite for `ctxgate stats`. None: on for the enterprise profile."""
    checkpoint_every: int = Field(default=100, gt=0)
    """A CHECKPOINT after this many events (professional: 100), and after every compaction."""
    archive_every: int = Field(default=10, gt=0)
    """Every this many checkpoints, the events before the latest one move to wal_archive/."""
    archive_retention_days: float = Field(default=7.0, gt=0)
    recover_on_start: int = Field(default=256, ge=0)
    """At start, rebuild this many sessions (the most recently written logs) in the background;
    any other is rebuilt when it is first seen."""
    store_content: bool = False
    """Keep user content in USER_INPUT events; by default only its hash is kept."""
    idempotency_ttl_s: float = Field(default=24 * 3600.0, gt=0)
    idempotency_max_per_tenant: int = Field(default=1000, gt=0)

    def enabled_for(self, profile: str) -> bool:
        return self.enabled if self.enabled is not None else profile != "minimal"

    def sqlite_for(self, profile: str) -> bool:
        return self.sqlite if self.sqlite is not None else profile == "enterprise"
