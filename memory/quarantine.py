"""Quarantined entries: what a consolidation could not vet waits here for the next one.

A dream that fails or times out writes its candidates raw (the spec's pitfall 4: nothing is
lost, nothing blocks), but a raw entry is text no model has vetted and may be a tool's or a
web page's: it is stored with its provenance and a `Quarantine`, never injected, and retried
by the tenant's next dream, with backoff, at most `MAX_ATTEMPTS` times; then it expires
(is removed). It lives in the long-term store, so it survives a restart wherever the store
does. Captured entries stored before provenance existed count as quarantined too
(`MemoryEntry.quarantined`) but are never retried: nothing says whose they are, so they wait
for an operator to review (`PATCH` releases) or purge them.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from .dream import FIRST_RETRY_S, Consolidator, Dream, consolidate_group, merged_data
from .entries import Category, MemoryEntry
from .facts import merged_provenance
from .short_term import Candidate, SessionBuffer
from .store import LongTermStore

log = logging.getLogger("ctxgate.memory")
MAX_ATTEMPTS = 5
MAX_BACKOFF_S = 86400.0


def backoff(attempts: int) -> float:
    """Seconds until the next try after `attempts` failed ones: 5 minutes, then four times longer, at most a day."""
    return min(MAX_BACKOFF_S, FIRST_RETRY_S * 4 ** max(0, attempts - 1))


async def retry_quarantined(tenant: str, store: LongTermStore, model: Consolidator, ttl_s: dict[str, float],
                            shared: frozenset[Category], now: float, timeout: float | None) -> dict[str, int]:
    """Consolidate the tenant's quarantined entries that are due, a group per category and
    scope; what was vetted, deferred and expired."""
    due = [e for e in await store.list(tenant, now=now)
           if e.quarantine is not None and e.quarantine.next_attempt_at <= now]
    groups: dict[tuple[Category, str | None, str | None, str | None], list[MemoryEntry]] = {}
    for e in due:
        groups.setdefault((e.category, e.user, e.project, e.owner), []).append(e)
    counts = {"vetted": 0, "deferred": 0, "expired": 0}
    for (category, _, project, owner), group in groups.items():
        session = group[0].provenance[0].session if group[0].provenance else None
        dream = Dream(SessionBuffer(tenant, owner, project), session or "", model, ttl_s, shared)
        try:
            await _vet(dream, category, group, store, now, timeout)
            counts["vetted"] += len(group)
        except (asyncio.TimeoutError, Exception) as e:
            for entry in group:
                expired = await _defer(store, entry, now, e)
                counts["expired" if expired else "deferred"] += 1
    return counts


async def _vet(dream: Dream, category: Category, group: list[MemoryEntry], store: LongTermStore, now: float,
               timeout: float | None) -> None:
    if category == Category.FEEDBACK:  # verbatim, the person's own correction: nothing to consolidate
        for entry in group:
            released = entry.model_copy(deep=True)
            released.quarantine = None
            await store.put(released)
        return
    candidates = [Candidate(category, e.content, dict(e.data), e.created_at) for e in group]
    sources: list[Any] = []
    for e in group:
        sources = merged_provenance(sources, e.provenance)
    work = consolidate_group(dream, category, [e.content for e in group], merged_data(category, candidates), sources,
                             store, now)
    written = await (asyncio.wait_for(work, timeout) if timeout is not None else work)
    kept = {w.id for w in written}
    for entry in group:
        if entry.id not in kept:
            await store.delete(entry.tenant, entry.id)


async def _defer(store: LongTermStore, entry: MemoryEntry, now: float, error: BaseException) -> bool:
    """One more failed try: retried later, or expired after MAX_ATTEMPTS. True when expired."""
    assert entry.quarantine is not None
    attempts = entry.quarantine.attempts + 1
    if attempts >= MAX_ATTEMPTS:
        log.warning("memory entry %s of tenant %s: %d consolidations failed (last: %s); it expires unvetted",
                    entry.id, entry.tenant, attempts, error)
        await store.delete(entry.tenant, entry.id)
        return True
    deferred = entry.model_copy(deep=True)
    assert deferred.quarantine is not None
    deferred.quarantine.attempts, deferred.quarantine.next_attempt_at = attempts, now + backoff(attempts)
    await store.put(deferred)
    return False
