"""The four categories of memory and one entry of them (docs/memory.md).

Every entry has a text `content` (what the loader injects) and a `data` dict with the
category's own structure: User `preferences`/`history`; Feedback `correction_type`,
`original_action`, `corrected_action`, `context_snippet`, `ttl_s`; Project `root_path`,
`file_index`, `tech_stack`, `conventions`, `last_scan`; Reference `source`, `topic`,
`summary`, `original_length`.
"""
from __future__ import annotations

import time
import uuid
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field


class Category(str, Enum):
    USER = "user"
    FEEDBACK = "feedback"
    PROJECT = "project"
    REFERENCE = "reference"


PRIORITY = (Category.USER, Category.FEEDBACK, Category.PROJECT, Category.REFERENCE)
"""The order the loader fills its share of the budget in."""

FEEDBACK_TTL_S = {"code_style": 30 * 86400.0, "tool_choice": 7 * 86400.0, "approach": 14 * 86400.0,
                  "other": 14 * 86400.0}
"""Default lifetime of a feedback entry by its correction type (configurable)."""
REFERENCE_SUMMARY_TOKENS = 500


class MemoryEntry(BaseModel):
    id: str = Field(default_factory=lambda: "mem_" + uuid.uuid4().hex)
    category: Category
    tenant: str
    user: str | None = None
    """User memory: whose (None: every user of the tenant)."""
    project: str | None = None
    """Project and feedback memory: which project (None: every project of the tenant)."""
    content: str
    data: dict[str, Any] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    expires_at: float | None = None
    origin: Literal["api", "capture"] = "api"
    """Who wrote it: a client through the API, or ctxgate from what sessions taught (auto-dream,
    the project scan). Only captured entries are evicted to make room (memory/limits.py)."""

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def visible_to(self, user: str | None, project: str | None) -> bool:
        """The scope rule: user memory per user, project and feedback per project, reference
        for the whole tenant; an entry without a user or project applies to all of them."""
        if self.category == Category.USER:
            return self.user is None or self.user == user
        if self.category in (Category.PROJECT, Category.FEEDBACK):
            return self.project is None or self.project == project
        return True


def feedback_expiry(correction_type: str, now: float, ttl_s: dict[str, float] | None = None) -> float:
    table = ttl_s or FEEDBACK_TTL_S
    return now + table.get(correction_type, table.get("other", FEEDBACK_TTL_S["other"]))
