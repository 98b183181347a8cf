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


SourceKind = Literal["human", "scaffolding", "tool_output", "document", "api"]
"""What produced the text an entry came from: the person's own words; an agent's scaffolding
(system reminders, instruction files, worked examples); a tool's output or an observation
sent as a user turn; a fetched document; a client writing through the memory API."""
MAX_PROVENANCE = 8
SPAN_CHARS = 2000
"""The verbatim span kept per source."""


class Provenance(BaseModel):
    """One sighting of an entry's fact: whose traffic, where, and the text it came from."""
    tenant: str
    user: str | None = None
    project: str | None = None
    session: str | None = None
    turn: int | None = None
    """The session's turn (its request count) the message arrived in."""
    door: str | None = None
    """chat, messages, responses; api for the memory API."""
    source: SourceKind
    span: str = ""
    """The verbatim text it came from (at most SPAN_CHARS)."""
    at: float = Field(default_factory=time.time)


class Quarantine(BaseModel):
    """A raw entry waiting for a consolidation to vet it (docs/memory.md, quarantine)."""
    reason: str
    attempts: int = 0
    next_attempt_at: float = 0.0


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
    provenance: list[Provenance] = Field(default_factory=list)
    """Where it came from, the first sighting first (a confirmation adds one, at most
    `MAX_PROVENANCE`). A captured entry without any was stored before provenance existed:
    it is quarantined (`quarantined`)."""
    confirmations: int = 1
    """How many times the same fact was captured (`fact_key`): each refreshes its TTL."""
    shared: bool = False
    """A captured entry reaches only the user who produced it, unless shared (a tenant setting,
    the API or an admin)."""
    quarantine: Quarantine | None = None
    """Set on a raw entry a consolidation could not vet: stored, never injected."""

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    @property
    def owner(self) -> str | None:
        """The user whose traffic a captured entry came from (None: a request without a user id)."""
        return self.provenance[0].user if self.provenance else self.user

    @property
    def quarantined(self) -> bool:
        return self.quarantine is not None or (self.origin == "capture" and not self.provenance)

    def visible_to(self, user: str | None, project: str | None) -> bool:
        """The scope rule: user memory per user, project and feedback per project, reference
        for the whole tenant; an entry without a user or project applies to all of them. A
        captured entry, unless shared, reaches only its owner."""
        if self.origin == "capture" and not self.shared and self.owner != user:
            return False
        if self.category == Category.USER:
            return self.user is None or self.user == user
        if self.category in (Category.PROJECT, Category.FEEDBACK):
            return self.project is None or self.project == project
        return True

    def injectable_to(self, user: str | None, project: str | None, now: float) -> bool:
        """What the loader may put into a prompt: visible, unexpired, not quarantined."""
        return not self.quarantined and not self.expired(now) and self.visible_to(user, project)

    def names(self, *, user: str | None = None, session: str | None = None) -> bool:
        """Whether any of its sources is this user's (or this session's): what deleting that
        user's (session's) data removes."""
        return any((user is not None and p.user == user) or (session is not None and p.session == session)
                   for p in self.provenance) or (user is not None and self.user == user)


def fact_key(category: Category, content: str, user: str | None, project: str | None, owner: str | None) -> str:
    """The same fact in the same category and scope: what a second capture updates instead
    of copying (case, spacing and trailing punctuation do not matter)."""
    text = " ".join(content.casefold().split()).rstrip(".!?;:, ")
    return "\x00".join((category.value, user or "", project or "", owner or "", text))


def feedback_expiry(correction_type: str, now: float, ttl_s: dict[str, float] | None = None) -> float:
    table = ttl_s or FEEDBACK_TTL_S
    return now + table.get(correction_type, table.get("other", FEEDBACK_TTL_S["other"]))
