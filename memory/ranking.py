"""Ranking shared by the stores that keep a tenant's entries in memory (files, Redis)."""
from __future__ import annotations

from .entries import Category, MemoryEntry
from .relevance import LexicalIndex


_ANYONE = object()


class TenantView:
    """A tenant's entries at one version, with their lexical index."""

    def __init__(self, version: int, entries: list[MemoryEntry]) -> None:
        self.version = version
        self.entries = {e.id: e for e in entries}
        # Plain tuples per category: the scope and expiry filter runs over every entry of a query.
        # Quarantined entries are never found; a private captured entry only by its owner.
        self._rows: dict[Category, list[tuple[MemoryEntry, str | None, str | None, float | None, object]]] = {}
        for e in entries:
            if not e.quarantined:
                private = e.owner if e.origin == "capture" and not e.shared else _ANYONE
                self._rows.setdefault(e.category, []).append((e, e.user, e.project, e.expires_at, private))
        self.index = LexicalIndex()
        for e in entries:
            self.index.add(e.id, e.content)

    def search(self, query: str, categories: tuple[Category, ...], user: str | None, project: str | None,
               limit: int, now: float) -> list[tuple[MemoryEntry, float]]:
        """Visible (`MemoryEntry.visible_to`), unexpired, unquarantined entries of `categories`,
        best score first; entries that share no word with the query follow, newest first (user
        preferences apply whatever is asked)."""
        scores = self.index.scores(query)
        found: list[tuple[MemoryEntry, float]] = []
        for category in categories:
            by_user = category == Category.USER
            scoped = category in (Category.PROJECT, Category.FEEDBACK)
            for e, owner, where, expires, private in self._rows.get(category, ()):
                if (expires is not None and expires <= now) or (private is not _ANYONE and private != user):
                    continue
                if ((by_user and owner is not None and owner != user)
                        or (scoped and where is not None and where != project)):
                    continue
                found.append((e, scores.get(e.id, 0.0)))
        found.sort(key=lambda pair: (-pair[1], -pair[0].updated_at, pair[0].id))
        return found[:limit]
