"""One fact, one entry: a captured fact seen again confirms the entry that holds it.

The same fact is the same normalised text in the same category and scope, of the same
owner (`entries.fact_key`). A second capture updates that entry: one more confirmation, its
TTL refreshed, the new sighting added to its provenance; never a second copy.
"""
from __future__ import annotations

from .entries import MAX_PROVENANCE, MemoryEntry, Provenance, fact_key
from .store import LongTermStore


def key_of(entry: MemoryEntry) -> str:
    return fact_key(entry.category, entry.content, entry.user, entry.project, entry.owner)


def merged_provenance(old: list[Provenance], new: list[Provenance]) -> list[Provenance]:
    """`old` then the sightings of `new` it lacks (by user, session and source), at most
    MAX_PROVENANCE: the first sighting and the newest are kept."""
    seen = {(p.user, p.session, p.source) for p in old}
    out = [*old, *(p for p in new if (p.user, p.session, p.source) not in seen)]
    return out if len(out) <= MAX_PROVENANCE else [out[0], *out[-(MAX_PROVENANCE - 1):]]


async def remember(store: LongTermStore, entry: MemoryEntry) -> MemoryEntry:
    """Write a captured `entry`, or confirm the entry that already holds its fact. A vetted
    copy of a quarantined fact releases it; a raw copy of a vetted one only confirms it."""
    key = key_of(entry)
    for old in await store.list(entry.tenant, entry.category):
        if old.id == entry.id or old.origin != "capture" or key_of(old) != key:
            continue
        merged = old.model_copy(deep=True)
        merged.confirmations += entry.confirmations
        merged.updated_at = max(old.updated_at, entry.updated_at)
        merged.expires_at = entry.expires_at
        merged.provenance = merged_provenance(old.provenance, entry.provenance)
        merged.shared = old.shared or entry.shared
        merged.data = {**old.data, **entry.data}
        if entry.quarantine is None:
            merged.quarantine = None
        await store.put(merged)
        return merged
    await store.put(entry)
    return entry
