"""Ranking shared by the stores that keep a tenant's entries in memory (files, Redis)."""
from __future__ import annotations

from .entries import Category, MemoryEntry
from .relevance import LexicalIndex


class TenantView:
    """A tenant's entries at one version, with their lexical index."""

    def __init__(self, version: int, entries: list[MemoryEntry]) -> None:
        self.version = version
        self.entries = {e.id: e for e in entries}
        self.index = LexicalIndex()
        for e in entries:
            self.index.add(e.id, e.content)

    def search(self, query: str, categories: tuple[Category, ...], user: str | None, project: str | None,
               limit: int, now: float) -> list[tuple[MemoryEntry, float]]:
        """Visible, unexpired entries of `categories`, best score first; entries that share no
        word with the query follow, newest first (user preferences apply whatever is asked)."""
        scores = self.index.scores(query)
        found = [(e, scores.get(e.id, 0.0)) for e in self.entries.values()
                 if e.category in categories and not e.expired(now) and e.visible_to(user, project)]
        found.sort(key=lambda pair: (-pair[1], -pair[0].updated_at, pair[0].id))
        return found[:limit]
