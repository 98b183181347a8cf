"""The enterprise long-term store: Qdrant, ranked by vector similarity.

`AsyncQdrantClient(path=...)` (local mode, the default) or a Qdrant server by `url=`.
One collection per category, `<prefix>_<category>`, created on first write with the size
of the first embedding. A point's payload is the MemoryEntry JSON (`entry`) plus the
fields queries filter on: `tenant` (every query must match it, so tenants never mix),
`user`, `project`, `expires_at`. Point ids are uuid5 of tenant and entry id (Qdrant
takes only UUIDs or integers), so two tenants' entries with one id are two points.

Version: one point per tenant in `<prefix>_meta` (no vector) holding a random 62-bit
token replaced after every write. It lives in Qdrant, not in the process, because
replicas sharing a Qdrant server must all see a write; a random token rather than a
counter because Qdrant has no atomic increment, and two writers racing on a read-add-
write could both write the same number. Equality is all the loader compares.

Local mode lets one client open a path per process: a store owns its client and closes
it in `close()`. A server that cannot be reached raises
`qdrant_client.http.exceptions.ResponseHandlingException` (its `source` an httpx
transport error); the embedding callable raises whatever its provider raises.
"""
from __future__ import annotations

import builtins
import secrets
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from qdrant_client import AsyncQdrantClient, models

from .entries import Category, MemoryEntry

Embed = Callable[[list[str]], Awaitable[list[list[float]]]]
_NS = uuid.UUID("5b0c1f3e-2f6a-4c1d-9a7e-6d3c2b1a0f99")
_PAGE = 1000


def _match(key: str, value: str) -> models.FieldCondition:
    return models.FieldCondition(key=key, match=models.MatchValue(value=value))


def _none_or(key: str, value: str | None) -> models.Filter:
    """The scope rule of MemoryEntry.visible_to: no value (every one), or this one."""
    empty = models.IsEmptyCondition(is_empty=models.PayloadField(key=key))
    return models.Filter(should=[empty] if value is None else [empty, _match(key, value)])


def _lasting(now: float) -> models.Filter:
    return models.Filter(should=[models.IsEmptyCondition(is_empty=models.PayloadField(key="expires_at")),
                                 models.FieldCondition(key="expires_at", range=models.Range(gt=now))])


class QdrantMemoryStore:
    def __init__(self, embed: Embed, path: str | Path | None = None, url: str | None = None,
                 prefix: str = "ctxgate", timeout_s: int = 10) -> None:
        if (path is None) == (url is None):
            raise ValueError("give exactly one of path (local mode) or url (a Qdrant server)")
        self._embed = embed
        self._local = url is None
        self._client = (AsyncQdrantClient(path=str(path)) if url is None
                        else AsyncQdrantClient(url=url, timeout=timeout_s, check_compatibility=False))
        self._prefix = prefix
        self._ready: set[str] = set()

    def _collection(self, category: Category) -> str:
        return f"{self._prefix}_{category.value}"

    @property
    def _meta(self) -> str:
        return f"{self._prefix}_meta"

    @staticmethod
    def _point_id(tenant: str, key: str) -> str:
        return str(uuid.uuid5(_NS, f"{tenant}\x00{key}"))

    async def _exists(self, name: str) -> bool:
        # Only a positive answer is cached: another replica may create the collection.
        if name not in self._ready and await self._client.collection_exists(name):
            self._ready.add(name)
        return name in self._ready

    async def _create(self, name: str, vectors: models.VectorParams | dict[str, Any]) -> None:
        if await self._exists(name):
            return
        try:
            await self._client.create_collection(name, vectors_config=vectors)
        except ValueError:  # local mode: created meanwhile by a concurrent put
            pass
        except Exception:   # a server answers 409 to a replica that lost the race
            if not await self._client.collection_exists(name):
                raise
        # Payload indexes make filtered search fast on a server; local mode ignores them (and warns).
        if not self._local:
            for key in ("tenant", "user", "project"):
                await self._client.create_payload_index(name, key, models.PayloadSchemaType.KEYWORD)
            await self._client.create_payload_index(name, "expires_at", models.PayloadSchemaType.FLOAT)
        self._ready.add(name)

    async def _existing(self, categories: tuple[Category, ...] = tuple(Category)) -> list[tuple[Category, str]]:
        return [(c, self._collection(c)) for c in categories if await self._exists(self._collection(c))]

    async def _bump(self, tenant: str) -> None:
        await self._create(self._meta, {})
        await self._client.upsert(self._meta, points=[models.PointStruct(
            id=self._point_id(tenant, ""), vector={}, payload={"tenant": tenant, "version": secrets.randbits(62)})])

    @staticmethod
    def _entry(payload: dict[str, Any] | None, tenant: str) -> MemoryEntry | None:
        # The filter already matched the tenant; checking again costs nothing and keeps a
        # uuid5 collision, however unlikely, from crossing tenants.
        if not payload or payload.get("tenant") != tenant:
            return None
        return MemoryEntry.model_validate(payload["entry"])

    async def put(self, entry: MemoryEntry) -> None:
        [vector] = await self._embed([entry.content])
        target = self._collection(entry.category)
        await self._create(target, models.VectorParams(size=len(vector), distance=models.Distance.COSINE))
        pid = self._point_id(entry.tenant, entry.id)
        for _, name in await self._existing():
            if name != target:  # an entry moved to another category leaves the old one
                await self._client.delete(name, points_selector=models.PointIdsList(points=[pid]))
        payload = {"tenant": entry.tenant, "user": entry.user, "project": entry.project,
                   "expires_at": entry.expires_at, "entry": entry.model_dump(mode="json")}
        await self._client.upsert(target, points=[models.PointStruct(id=pid, vector=vector, payload=payload)])
        await self._bump(entry.tenant)

    async def get(self, tenant: str, entry_id: str) -> MemoryEntry | None:
        pid = self._point_id(tenant, entry_id)
        for _, name in await self._existing():
            for record in await self._client.retrieve(name, [pid], with_payload=True):
                if (entry := self._entry(record.payload, tenant)) is not None:
                    return entry
        return None

    async def delete(self, tenant: str, entry_id: str) -> bool:
        if await self.get(tenant, entry_id) is None:
            return False
        pid = self._point_id(tenant, entry_id)
        for _, name in await self._existing():
            await self._client.delete(name, points_selector=models.PointIdsList(points=[pid]))
        await self._bump(tenant)
        return True

    async def _scroll(self, name: str, flt: models.Filter) -> list[models.Record]:
        records, offset = [], None
        while True:
            page, offset = await self._client.scroll(name, scroll_filter=flt, limit=_PAGE, offset=offset,
                                                     with_payload=True)
            records += page
            if offset is None:
                return records

    async def list(self, tenant: str, category: Category | None = None,
                   now: float | None = None) -> builtins.list[MemoryEntry]:
        must: list[Any] = [_match("tenant", tenant)] + ([] if now is None else [_lasting(now)])
        out = []
        for _, name in await self._existing(tuple(Category) if category is None else (category,)):
            out += [e for r in await self._scroll(name, models.Filter(must=must))
                    if (e := self._entry(r.payload, tenant)) is not None]
        return sorted(out, key=lambda e: (e.created_at, e.id))

    async def search(self, tenant: str, query: str, categories: tuple[Category, ...], user: str | None,
                     project: str | None, limit: int, now: float) -> builtins.list[tuple[MemoryEntry, float]]:
        """Nearest entries by cosine similarity, per category collection, merged."""
        collections = await self._existing(categories)
        if not collections or limit <= 0:
            return []
        [vector] = await self._embed([query])
        found: list[tuple[MemoryEntry, float]] = []
        for category, name in collections:
            must: list[Any] = [_match("tenant", tenant), _lasting(now)]
            if category == Category.USER:
                must.append(_none_or("user", user))
            elif category in (Category.PROJECT, Category.FEEDBACK):
                must.append(_none_or("project", project))
            result = await self._client.query_points(name, query=vector, query_filter=models.Filter(must=must),
                                                     limit=limit, with_payload=True)
            found += [(e, p.score) for p in result.points if (e := self._entry(p.payload, tenant)) is not None]
        found.sort(key=lambda pair: (-pair[1], -pair[0].updated_at, pair[0].id))
        return found[:limit]

    async def version(self, tenant: str) -> int:
        if not await self._exists(self._meta):
            return 0
        records = await self._client.retrieve(self._meta, [self._point_id(tenant, "")], with_payload=True)
        return int(records[0].payload["version"]) if records and records[0].payload else 0

    async def purge_expired(self, tenant: str, now: float) -> int:
        expired = models.FieldCondition(key="expires_at", range=models.Range(lte=now))
        removed = 0
        for _, name in await self._existing():
            must: list[models.Condition] = [_match("tenant", tenant), expired]
            flt = models.Filter(must=must)
            ids = [r.id for r in await self._scroll(name, flt)]
            if ids:
                # Deleted by ids *and* the expiry condition: an entry replaced meanwhile by a
                # lasting one stays.
                await self._client.delete(name, points_selector=models.FilterSelector(filter=models.Filter(
                    must=[models.HasIdCondition(has_id=ids), *must])))
                removed += len(ids)
        if removed:
            await self._bump(tenant)
        return removed

    async def close(self) -> None:
        await self._client.close()
