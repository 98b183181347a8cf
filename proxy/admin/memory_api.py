"""`/v1/ctx/memory`: list (a page at a time, filtered by category, scope, origin, source,
status or session), add, update (share, release from quarantine) and delete memory entries,
one or every entry a filter matches, for the caller's tenant only. An entry of another tenant
is answered exactly like one that does not exist (404). Scope ids follow the one id rule
(proxy/ids.py); a write past the tenant's caps (memory/limits.py) is refused and changes
nothing. Every entry is shown with its provenance: where each sighting of its fact came from."""
from __future__ import annotations

import base64
import binascii
import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator, Literal, get_args

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from ctxgate.memory.entries import Category, MemoryEntry, Provenance, SourceKind, feedback_expiry
from ctxgate.memory.limits import MemoryFull, entry_bytes
from ctxgate.memory.store import LongTermStore
from ..errors import ErrorKind, GatewayError
from ..gateway import Gateway
from ..engine.state import reachable
from ..ids import require_id
from ..numbers import whole_number
from ..tenancy import resolve_caller

log = logging.getLogger("ctxgate.memory")

DEFAULT_PAGE = 100
MAX_PAGE = 1000


class _Scope(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user: str | None = None
    project: str | None = None

    def checked(self) -> _Scope:
        """The one id rule, with the same 400 as the headers that name a user or project."""
        for what in ("user", "project"):
            if (value := getattr(self, what)) is not None:
                require_id(value, what, f"scope.{what}")
        return self


class NewEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    category: Category
    content: str = Field(min_length=1)
    scope: _Scope = Field(default_factory=_Scope)
    data: dict[str, Any] = Field(default_factory=dict)
    ttl_s: float | None = Field(default=None, gt=0)
    """Feedback: its lifetime (default: by `data.correction_type`, code_style 30 days, tool_choice 7)."""


class EntryChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str | None = Field(default=None, min_length=1)
    scope: _Scope | None = None
    data: dict[str, Any] | None = None
    ttl_s: float | None = Field(default=None, gt=0)
    shared: StrictBool | None = None
    """A captured entry reaches its owner only, unless shared with the tenant's other users."""
    status: Literal["active"] | None = None
    """`active` releases a quarantined entry: an operator vetted it (to purge one, delete it)."""


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        raw = orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"the body is not JSON: {e}", code="invalid_json") from None
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise GatewayError(ErrorKind.INVALID_REQUEST,
                           f"{where}: {first['msg']}", param=where, code="invalid_request") from None


@contextmanager
def _store_reachable() -> Iterator[None]:
    """A store that fails (Redis or a Qdrant server unreachable, a full disk) is a 503 the
    client may retry, never a 500; the cause is in the server's log."""
    try:
        with reachable():
            yield
    except GatewayError:
        raise
    except Exception as e:
        log.exception("memory store call failed")
        raise GatewayError(ErrorKind.UNAVAILABLE, f"the memory store is unavailable ({type(e).__name__})",
                       code="memory_unavailable") from None


def _status(entry: MemoryEntry) -> str:
    return "quarantined" if entry.quarantined else "active"


def _public(entry: MemoryEntry) -> dict[str, Any]:
    data = entry.model_dump(mode="json")
    data["scope"] = {"user": data.pop("user"), "project": data.pop("project")}
    data.pop("tenant")
    for source in data["provenance"]:
        source.pop("tenant")  # always the caller's
    data["status"] = _status(entry)
    return data


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _category(wanted: str | None) -> Category | None:
    try:
        return Category(wanted) if wanted else None
    except ValueError:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"category must be one of {', '.join(c.value for c in Category)}",
                           param="category", code="invalid_request") from None


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_PAGE
    return whole_number(raw, "limit", 1, MAX_PAGE)


FILTERS = ("category", "user", "project", "origin", "source", "status", "session")
"""What a list, or a bulk delete, selects entries by (every one given must match)."""
_CHOICES = {"origin": ("api", "capture"), "source": get_args(SourceKind), "status": ("active", "quarantined")}


class _Filter:
    """The query's filters, checked: a bad value is a 400 naming its parameter."""

    def __init__(self, query: Any) -> None:
        self.category = _category(query.get("category"))
        ids = {what: None if (v := query.get(what)) is None else require_id(v, what, what)
               for what in ("user", "project", "session")}
        self.user, self.project, self.session = ids["user"], ids["project"], ids["session"]
        for what, allowed in _CHOICES.items():
            if (value := query.get(what)) is not None and value not in allowed:
                raise GatewayError(ErrorKind.INVALID_REQUEST, f"{what} must be one of {', '.join(allowed)}",
                                   param=what, code="invalid_request")
        self.origin, self.source, self.status = query.get("origin"), query.get("source"), query.get("status")
        self.given = [what for what in FILTERS if query.get(what) is not None]

    def matches(self, e: MemoryEntry) -> bool:
        """`user`: its user scope, or a sighting in that user's traffic (the owner's included)."""
        return ((self.user is None or e.names(user=self.user))
                and (self.project is None or e.project == self.project)
                and (self.session is None or e.names(session=self.session))
                and (self.origin is None or e.origin == self.origin)
                and (self.source is None or any(p.source == self.source for p in e.provenance))
                and (self.status is None or _status(e) == self.status))


def _cursor(entry: MemoryEntry) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([entry.created_at, entry.id])).decode().rstrip("=")


def _position(cursor: str | None) -> tuple[float, str] | None:
    """Where the page before ended: (created_at, id) of its last entry, the list's order."""
    if cursor is None:
        return None
    try:
        created_at, entry_id = orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if isinstance(created_at, (int, float)) and isinstance(entry_id, str):
            return float(created_at), entry_id
    except (ValueError, TypeError, binascii.Error):
        pass
    raise GatewayError(ErrorKind.INVALID_REQUEST, "cursor is not a next_cursor this endpoint returned",
                       param="cursor", code="invalid_cursor")


def _written(tenant: str, scope: _Scope, now: float) -> Provenance:
    """An entry a client wrote (or an operator vetted) through this API."""
    return Provenance(tenant=tenant, user=scope.user, project=scope.project, door="api", source="api", at=now)


def _place(entry: MemoryEntry, scope: _Scope) -> None:
    """The scope a category has: user memory per user, project and feedback per project."""
    entry.user = scope.user if entry.category == Category.USER else None
    entry.project = scope.project if entry.category in (Category.PROJECT, Category.FEEDBACK) else None


class MemoryApi:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def _store_and_tenant(self, request: web.Request) -> tuple[LongTermStore, str]:
        tenant = resolve_caller(self.gw.config, request.headers).tenant
        if self.gw.memory is None:
            raise GatewayError(ErrorKind.NOT_FOUND, "memory is not enabled on this gateway", code="memory_disabled")
        return self.gw.memory.store, tenant

    def _expiry(self, category: Category, data: dict[str, Any], ttl_s: float | None, now: float) -> float | None:
        if ttl_s is not None:
            return now + ttl_s
        if category == Category.FEEDBACK:
            return feedback_expiry(str(data.get("correction_type", "other")), now,
                                   self.gw.config.ctxgate.memory.feedback_ttl_s())
        return None

    async def list(self, request: web.Request) -> web.Response:
        """A page of the tenant's unexpired entries, oldest first: `limit` (default 100, at
        most 1000) and `cursor`, the `next_cursor` of the page before; `has_more` says
        whether there is another page. Entries added or removed meanwhile neither shift nor
        repeat the rest: a cursor names a position, not an offset."""
        store, tenant = self._store_and_tenant(request)
        wanted = _Filter(request.query)
        limit = _limit(request.query.get("limit"))
        after = _position(request.query.get("cursor"))
        with _store_reachable():
            entries = await store.list(tenant, wanted.category, now=time.time())
        page = [e for e in entries if wanted.matches(e) and (after is None or (e.created_at, e.id) > after)][:limit + 1]
        more = len(page) > limit
        page = page[:limit]
        return _json({"object": "list", "data": [_public(e) for e in page], "has_more": more,
                      "next_cursor": _cursor(page[-1]) if more else None})

    def _fits(self, entry: MemoryEntry) -> None:
        limit = self.gw.config.ctxgate.memory.max_entry_bytes
        if (size := entry_bytes(entry)) > limit:
            raise GatewayError(ErrorKind.TOO_LARGE, f"this entry's content and data are {size} bytes as JSON, over "
                               f"the {limit} an entry may have (ctxgate.memory.max_entry_bytes)",
                               param="content", code="memory_entry_too_large")

    async def _put(self, store: LongTermStore, entry: MemoryEntry) -> None:
        self._fits(entry)
        with _store_reachable():
            try:
                await store.put(entry)
            except MemoryFull as e:  # the tenant's caps: a 422 that changed nothing, not a store failure
                raise GatewayError(ErrorKind.CONFLICT, str(e), code=e.code) from None

    async def add(self, request: web.Request) -> web.Response:
        store, tenant = self._store_and_tenant(request)
        new: NewEntry = await _body(request, NewEntry)
        now = time.time()
        scope = new.scope.checked()
        entry = MemoryEntry(category=new.category, tenant=tenant, content=new.content, data=new.data, created_at=now,
                            updated_at=now, expires_at=self._expiry(new.category, new.data, new.ttl_s, now),
                            provenance=[_written(tenant, scope, now)])
        _place(entry, scope)
        await self._put(store, entry)
        return _json(_public(entry), 201)

    async def _own(self, store: LongTermStore, tenant: str, entry_id: str) -> MemoryEntry:
        with _store_reachable():
            entry = await store.get(tenant, entry_id)
        if entry is None or entry.tenant != tenant:
            raise GatewayError(ErrorKind.NOT_FOUND,
                               f"no memory entry {entry_id} for this tenant", code="memory_not_found")
        return entry

    async def update(self, request: web.Request) -> web.Response:
        store, tenant = self._store_and_tenant(request)
        change: EntryChange = await _body(request, EntryChange)
        if change.scope is not None:
            change.scope.checked()
        # A copy: the store's own object stays as it is if the write is refused.
        entry = (await self._own(store, tenant, request.match_info["entry_id"])).model_copy(deep=True)
        now = time.time()
        if change.content is not None:
            entry.content = change.content
        if change.data is not None:
            entry.data = change.data
        if change.scope is not None:
            _place(entry, change.scope)
        if change.ttl_s is not None:
            entry.expires_at = now + change.ttl_s
        if change.shared is not None:
            entry.shared = change.shared
        if change.status == "active" and entry.quarantined:
            entry.quarantine = None
            if not entry.provenance:  # captured before provenance existed: the operator vouches for it
                entry.provenance = [_written(tenant, _Scope(user=entry.user, project=entry.project), now)]
        entry.updated_at = now
        await self._put(store, entry)
        return _json(_public(entry))

    async def delete(self, request: web.Request) -> web.Response:
        store, tenant = self._store_and_tenant(request)
        entry = await self._own(store, tenant, request.match_info["entry_id"])
        with _store_reachable():
            await store.delete(tenant, entry.id)
        return _json({"id": entry.id, "object": "memory.entry.deleted", "deleted": True})

    async def delete_matching(self, request: web.Request) -> web.Response:
        """Every entry of the tenant the filters match (at least one filter; an unknown
        parameter is refused rather than ignored, so a typo never widens what goes)."""
        store, tenant = self._store_and_tenant(request)
        if unknown := sorted(set(request.query) - set(FILTERS)):
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"unknown filter {unknown[0]!r}: filters are "
                               f"{', '.join(FILTERS)}", param=unknown[0], code="invalid_request")
        wanted = _Filter(request.query)
        if not wanted.given:
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"name at least one filter ({', '.join(FILTERS)}); "
                               "deleting every entry takes an explicit one", code="filter_required")
        with _store_reachable():
            gone = [e for e in await store.list(tenant, wanted.category) if wanted.matches(e)]
            for entry in gone:
                await store.delete(tenant, entry.id)
        log.info("memory of tenant %s: %d entries deleted by %s", tenant, len(gone),
                 {what: request.query[what] for what in wanted.given})
        return _json({"object": "memory.entry.deleted_list", "deleted": len(gone), "ids": [e.id for e in gone]})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/ctx/memory", self.list)
        app.router.add_delete("/v1/ctx/memory", self.delete_matching)
        app.router.add_post("/v1/ctx/memory", self.add)
        app.router.add_patch("/v1/ctx/memory/{entry_id}", self.update)
        app.router.add_delete("/v1/ctx/memory/{entry_id}", self.delete)
