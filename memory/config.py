"""Memory settings (`ctxgate.memory` in the config file)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Trigger = Literal["A", "B", "C"]
# By profile: professional consolidates at session end only, enterprise on all three.
PROFILE_TRIGGERS: dict[str, list[Trigger]] = {"minimal": [], "professional": ["B"], "enterprise": ["A", "B", "C"]}
Shareable = Literal["user", "feedback", "project", "reference"]
# By profile: which captured categories a tenant's users share. A captured entry otherwise
# reaches only the user whose traffic it came from. No profile shares anything: what a tool, a
# file or a page produced reaches another user only when the operator says so (the tenant's
# `share_captured`, this setting, or the API).
PROFILE_SHARED: dict[str, list[Shareable]] = {"minimal": [], "professional": [], "enterprise": []}


class MemoryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = None
    """None: by profile (minimal keeps no memory)."""
    store: Literal["files", "redis", "vector"] | None = None
    """None: `redis` when the session state is in Redis, else `files`."""
    qdrant_path: str | None = None
    """Vector store in local mode (default `<data_dir>/qdrant`), unless `qdrant_url` names a server."""
    qdrant_url: str | None = None
    embedding_model: str | None = None
    """A `model_name` of `model_list` that answers /v1/embeddings (required by the vector store)."""
    budget_share: float = Field(default=0.05, gt=0, lt=1)
    """The injected memory block takes at most this share of the effective budget."""
    dream_model: str | None = None
    """Who consolidates (default: `pipeline.autocompact.model`, else the request's model)."""
    classifier_model: str | None = None
    """Optional: an LLM re-labels buffered entries the rules could not place (category `other`)."""
    triggers: list[Trigger] | None = None
    """Auto-dream triggers; None: by profile."""
    threshold_count: int = Field(default=20, gt=0)
    """Trigger A: more buffered entries than this."""
    dream_interval_s: float = Field(default=1800.0, gt=0)
    """Trigger C: this long since the last dream and more than 5 entries buffered."""
    idle_timeout_s: float = Field(default=1800.0, gt=0)
    """A session idle this long has ended (trigger B)."""
    end_timeout_s: float = Field(default=5.0, gt=0)
    """At session end, consolidation gets this long; then the raw entries are written as they are."""
    feedback_ttl_days: dict[str, float] = Field(default_factory=lambda: {
        "code_style": 30.0, "tool_choice": 7.0, "approach": 14.0, "other": 14.0})
    workspace_root: str | None = None
    """A readable project root to scan at session start and refresh by modification time."""
    max_entries: int = Field(default=2000, gt=0)
    """Per tenant: unexpired entries kept at most (memory/limits.py)."""
    max_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    """Per tenant: the entries' content and data, as UTF-8 JSON, at most this many bytes."""
    max_entry_bytes: int = Field(default=16 * 1024, gt=0)
    """One entry written through the API: its content and data at most this many bytes."""

    share_captured: list[Shareable] | None = None
    """Captured categories every user of the tenant sees; None: by profile (`PROFILE_SHARED`)."""

    def enabled_for(self, profile: str) -> bool:
        return self.enabled if self.enabled is not None else profile != "minimal"

    def triggers_for(self, profile: str) -> list[Trigger]:
        return self.triggers if self.triggers is not None else PROFILE_TRIGGERS.get(profile, ["B"])

    def shared_for(self, profile: str, tenant_setting: list[Shareable] | None = None) -> list[Shareable]:
        """The captured categories shared: the tenant's own setting, else this one, else the profile's."""
        if tenant_setting is not None:
            return tenant_setting
        return self.share_captured if self.share_captured is not None else PROFILE_SHARED.get(profile, [])

    def feedback_ttl_s(self) -> dict[str, float]:
        return {k: v * 86400.0 for k, v in self.feedback_ttl_days.items()}
