"""Auto-dream (docs/memory.md): consolidate a session's short-term buffer into long-term memory.

Classify, then per category: Reference, Project and User through the LLM with the
prompts below; Feedback persisted entry by entry, verbatim, with its TTL. The buffer is then
empty and an AUTO_DREAM event is reported. It always runs in a background task; with a
`timeout` (session end: 5 s) whatever is not consolidated by then is written raw.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import orjson

from .entries import Category, MemoryEntry, feedback_expiry
from .short_term import Candidate, SessionBuffer
from .store import LongTermStore

log = logging.getLogger("ctxgate.memory")
Complete = Callable[[list[dict[str, Any]]], Awaitable[str]]

PROMPTS = {
    Category.REFERENCE: "Merge the following related reference entries into one summary of at most 500 tokens. "
                        "Keep every reusable code pattern, API signature and key number.",
    Category.PROJECT: "Merge the following records of project structure changes into the existing project "
                      "memory. Update only what changed; do not repeat what did not.",
    Category.USER: "Extract the new preferences or changes of habit from the following user interactions. "
                   "Output only what changed; do not repeat preferences that already exist. Answer NONE if "
                   "nothing is new.",
}
CLASSIFY_PROMPT = ("Classify each numbered memory candidate as one of: user, feedback, project, reference, "
                   "drop. Answer with one JSON list of labels, in order, and nothing else.")


async def auto_dream(buffer: SessionBuffer, entries: list[Candidate], store: LongTermStore,
                     complete: Complete | None, ttl_s: dict[str, float], timeout: float | None,
                     classify: Complete | None = None, now: float | None = None) -> dict[str, Any]:
    """Consolidate `entries`; returns the AUTO_DREAM event's fields."""
    at = time.time() if now is None else now
    classified = await _classify(entries, classify)
    written: list[MemoryEntry] = []
    done: set[Category] = set()
    raw = False
    try:
        work = _consolidate(buffer, classified, store, complete, ttl_s, at, written, done)
        await (asyncio.wait_for(work, timeout) if timeout is not None else work)
    except (asyncio.TimeoutError, Exception) as e:  # the LLM is slow or failing: nothing is lost
        raw = True
        log.warning("auto-dream of %s: consolidation %s; writing the raw entries",
                    buffer.tenant, "timed out" if isinstance(e, asyncio.TimeoutError) else f"failed ({e})")
        for category, group in classified.items():
            if category in done:
                continue
            for c in group:
                entry = _entry(buffer, category, c.content, dict(c.data), at, ttl_s)
                entry.data["unconsolidated"] = True
                await store.put(entry)
                written.append(entry)
    return {"entries_count": len(entries), "categories": sorted(c.value for c in classified),
            "written": len(written), "consolidated": not raw}


async def _classify(entries: list[Candidate], classify: Complete | None) -> dict[Category, list[Candidate]]:
    out: dict[Category, list[Candidate]] = {}
    unknown = [c for c in entries if c.category is None]
    labels: list[str] = []
    if unknown and classify is not None:
        listing = "\n".join(f"{i + 1}. {c.content[:500]}" for i, c in enumerate(unknown))
        try:
            labels = orjson.loads(await classify([{"role": "system", "content": CLASSIFY_PROMPT},
                                                  {"role": "user", "content": listing}]))
        except Exception as e:  # a classifier that fails leaves them unclassified, dropped below
            log.warning("memory classifier failed: %s", e)
        if not isinstance(labels, list):  # any other JSON is a failed answer too: the batch is kept
            log.warning("memory classifier answered %s, not a list of labels", type(labels).__name__)
            labels = []
    for i, c in enumerate(unknown):
        label = labels[i] if i < len(labels) and isinstance(labels[i], str) else "drop"
        if label in {x.value for x in Category}:
            c.category = Category(label)
    for c in entries:
        if c.category is not None:
            out.setdefault(c.category, []).append(c)
    return out


async def _consolidate(buffer: SessionBuffer, classified: dict[Category, list[Candidate]], store: LongTermStore,
                       complete: Complete | None, ttl_s: dict[str, float], at: float,
                       written: list[MemoryEntry], done: set[Category]) -> None:
    # Feedback first: it needs no LLM, so a timeout later cannot hold it back.
    for category, group in sorted(classified.items(), key=lambda kv: kv[0] != Category.FEEDBACK):
        if category == Category.FEEDBACK:  # verbatim: a correction must come back exactly as given
            for c in group:
                entry = _entry(buffer, category, c.content, dict(c.data), at, ttl_s)
                await store.put(entry)
                written.append(entry)
            done.add(category)
            continue
        if complete is None:
            raise RuntimeError("no model to consolidate with")
        existing = await _existing_project(store, buffer) if category == Category.PROJECT else None
        body = orjson.dumps({"existing": existing.content if existing else None,
                             "entries": [c.content for c in group]}).decode()
        text = (await complete([{"role": "system", "content": PROMPTS[category]},
                                {"role": "user", "content": body}])).strip()
        if category == Category.USER and text.upper().startswith("NONE"):
            done.add(category)
            continue
        data = _merged_data(category, group, existing)
        data["consolidated_from"] = len(group)
        entry = _entry(buffer, category, text, data, at, ttl_s)
        if existing is not None:
            entry.id, entry.created_at = existing.id, existing.created_at
        await store.put(entry)
        written.append(entry)
        done.add(category)


async def _existing_project(store: LongTermStore, buffer: SessionBuffer) -> MemoryEntry | None:
    for entry in await store.list(buffer.tenant, Category.PROJECT):
        if entry.project == buffer.project:
            return entry
    return None


def _merged_data(category: Category, group: list[Candidate], existing: MemoryEntry | None) -> dict[str, Any]:
    if category == Category.PROJECT:
        data = dict(existing.data) if existing else {}
        for c in group:
            data.setdefault("tech_stack", {}).update(c.data.get("tech_stack", {}))
            data.setdefault("file_index", {}).update(c.data.get("file_index", {}))
        return data
    if category == Category.REFERENCE:
        return {"sources": sorted({str(c.data.get("source")) for c in group}),
                "topic": group[0].data.get("topic", ""),
                "original_length": sum(int(c.data.get("original_length") or 0) for c in group)}
    return {"preferences": [c.data.get("preferences") for c in group]}


def _entry(buffer: SessionBuffer, category: Category, content: str, data: dict[str, Any], at: float,
           ttl_s: dict[str, float]) -> MemoryEntry:
    entry = MemoryEntry(category=category, tenant=buffer.tenant, content=content, data=data, created_at=at,
                        updated_at=at)
    if category == Category.USER:
        entry.user = buffer.user
    elif category in (Category.PROJECT, Category.FEEDBACK):
        entry.project = buffer.project
    if category == Category.FEEDBACK:
        entry.expires_at = feedback_expiry(str(data.get("correction_type", "other")), at, ttl_s)
        data["ttl_s"] = entry.expires_at - at
    return entry
