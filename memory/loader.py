"""MemoryContextLoader (docs/memory.md, injection): the memory blocks relevant to this turn, in priority
order (User, Feedback, Project, Reference), within the memory share of the budget, each
entry with its source. Only what the turn's user may see and nothing quarantined; the proxy
delivers the block as quoted context, never as instructions."""
from __future__ import annotations

from typing import Callable

from .entries import PRIORITY, Category, MemoryEntry
from .store import LongTermStore

HEADER = "Long-term memory (ctxgate): what is known about this user and project from earlier sessions."
_TITLES = {Category.USER: "User preferences", Category.FEEDBACK: "Corrections to keep in mind",
           Category.PROJECT: "Project", Category.REFERENCE: "Reference notes"}
_CANDIDATES = 200
# Preferences, corrections and the project apply whatever the turn asks; a reference note
# only when it shares words with the turn.
_NEEDS_MATCH = frozenset({Category.REFERENCE})


_SOURCES = {"human": "user said", "scaffolding": "agent context", "tool_output": "tool output",
            "document": "document", "api": "memory API"}


def source_label(entry: MemoryEntry) -> str:
    """Where an entry came from, as the block names it (a document with its address)."""
    if not entry.provenance:
        return _SOURCES["api"]
    first = entry.provenance[0]
    label = _SOURCES[first.source]
    url = entry.data.get("source") if first.source == "document" else None
    return f"{label} {url[:200]}" if isinstance(url, str) and url.startswith(("http://", "https://")) else label


class MemoryContextLoader:
    def __init__(self, store: LongTermStore) -> None:
        self.store = store

    async def block(self, tenant: str, user: str | None, project: str | None, query: str, budget_tokens: int,
                    count: Callable[[str], int], now: float) -> str:
        """The block's text, or "" when nothing fits or nothing is known."""
        hits = await self.store.search(tenant, query, PRIORITY, user, project, _CANDIDATES, now)
        by_category: dict[Category, list[MemoryEntry]] = {}
        for entry, score in hits:
            if not entry.injectable_to(user, project, now):
                continue
            if score > 0 or entry.category not in _NEEDS_MATCH:
                by_category.setdefault(entry.category, []).append(entry)
        lines = [HEADER]
        used = count(HEADER)
        for category in PRIORITY:
            title = f"## {_TITLES[category]}"
            section: list[str] = []
            for entry in by_category.get(category, []):
                line = f"- [{source_label(entry)}] " + " ".join(entry.content.split())
                cost = count(line) + (0 if section else count(title))
                if used + cost > budget_tokens:
                    continue  # a shorter entry further down may still fit
                section.append(line)
                used += cost
            if section:
                lines += [title, *section]
        return "\n".join(lines) if len(lines) > 1 else ""
