"""What the Responses door returned, per tenant, so `previous_response_id` resolves here.

Upstreams may not store (many providers have no Responses storage at all), and the
session ctxgate compacts must be the whole conversation. So ctxgate keeps, for each
response it returned, the items that request added, the reply's output items and the
response object, and expands a chain itself. A response made with `store: false` is not
kept, as OpenAI keeps none: such a client (Codex) resends its whole input every turn, and
keeping it would write the whole conversation again on every turn.

Files under the data directory (they survive a restart), or Redis when the state is
there (every replica sees them); `TTL_S` and `MAX_PER_TENANT` bound them. Only this door
reads them, so the store lives with the door.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import orjson
import xxhash

from ctxgate.redis_backend import RedisTarget
from ctxgate.redis_backend.indexed import erase_matching
from ctxgate.wal.archive import prune_folder, remove, remove_matching, write_atomically
from ctxgate.wal.paths import safe_name
from ..engine.state import reachable
from ..errors import ErrorKind, GatewayError

TTL_S = 30 * 24 * 3600
"""As long as OpenAI keeps a stored response."""
MAX_PER_TENANT = 10_000
"""The oldest go first beyond this."""
MAX_CHAIN = 10_000
"""A longer chain is refused rather than walked (a cycle, or a runaway client)."""
_CACHE_SIZE = 2048
_PRUNE_EVERY = 64


@dataclass(frozen=True)
class StoredResponse:
    id: str
    previous_response_id: str | None
    input: list[dict[str, Any]]
    """The items the request that made this response added (not its previous turns)."""
    output: list[dict[str, Any]]
    response: dict[str, Any]
    created_at: float
    session_id: str | None = None
    """The session the turn ran in: a chained request with no session of its own continues it."""

    def to_bytes(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> "StoredResponse":
        return cls(**orjson.loads(raw))


def not_found(response_id: str) -> GatewayError:
    return GatewayError(ErrorKind.INVALID_REQUEST,
                        f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                    code="previous_response_not_found")


class _Backend(Protocol):
    async def get(self, tenant: str, response_id: str) -> StoredResponse | None: ...
    async def put(self, tenant: str, stored: StoredResponse) -> None: ...
    async def delete(self, tenant: str, response_id: str) -> bool: ...
    async def touch(self, tenant: str, response_ids: list[str]) -> None: ...
    async def erase_sessions(self, tenant: str, sessions: set[str]) -> int: ...
    async def close(self) -> None: ...


class ResponseStore:
    """A backend and a small in-process cache for walking chains (stored responses never
    change; a deletion on another replica is seen once the entry leaves this cache)."""

    def __init__(self, backend: _Backend) -> None:
        self._backend = backend
        self._cache: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await self._backend.get(tenant, response_id)

    async def put(self, tenant: str, stored: StoredResponse) -> None:
        await self._backend.put(tenant, stored)
        self._remember((tenant, stored.id), stored)

    async def delete(self, tenant: str, response_id: str) -> bool:
        self._cache.pop((tenant, response_id), None)
        return await self._backend.delete(tenant, response_id)

    async def erase_sessions(self, tenant: str, sessions: set[str]) -> int:
        """Drop the tenant's stored responses made in these sessions (deleting their data); how many."""
        for key in [k for k, stored in self._cache.items() if k[0] == tenant and stored.session_id in sessions]:
            del self._cache[key]
        return await self._backend.erase_sessions(tenant, sessions)

    async def conversation(self, tenant: str, response_id: str) -> tuple[list[dict[str, Any]], str | None]:
        """Every item of the chain ending at `response_id`, oldest first (each turn's input
        then its output), and the session it ran in. Unknown to this tenant:
        `previous_response_not_found`."""
        turns: list[StoredResponse] = []
        seen: set[str] = set()
        next_id: str | None = response_id
        while next_id is not None:
            if next_id in seen or len(turns) >= MAX_CHAIN:
                raise GatewayError(ErrorKind.INVALID_REQUEST, f"the chain of '{response_id}' is too long or loops",
                               param="previous_response_id", code="invalid_previous_response")
            seen.add(next_id)
            stored = await self._cached(tenant, next_id)
            if stored is None:
                raise not_found(response_id if next_id == response_id else next_id)
            turns.append(stored)
            next_id = stored.previous_response_id
        # A chain in use is as new as its last turn: the store bounds a tenant by dropping the
        # least recently used, and dropping an old link would break every later turn.
        await self._backend.touch(tenant, [turn.id for turn in turns])
        items = [item for turn in reversed(turns) for item in (*turn.input, *turn.output)]
        return items, turns[0].session_id

    async def _cached(self, tenant: str, response_id: str) -> StoredResponse | None:
        key = (tenant, response_id)
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            if time.time() - found.created_at <= TTL_S:
                return found
        found = await self._backend.get(tenant, response_id)
        if found is not None:
            self._remember(key, found)
        return found

    def _remember(self, key: tuple[str, str], stored: StoredResponse) -> None:
        self._cache[key] = stored
        self._cache.move_to_end(key)
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)

    async def close(self) -> None:
        await self._backend.close()


class _Files:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._puts = 0

    def _path(self, tenant: str, response_id: str) -> Path:
        return self.root / safe_name(tenant) / (xxhash.xxh3_128_hexdigest(response_id.encode()) + ".json")

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        path = self._path(tenant, response_id)
        try:
            with _readable():
                stored = StoredResponse.from_bytes(await asyncio.to_thread(path.read_bytes))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None
        if time.time() - stored.created_at > TTL_S or stored.id != response_id:
            return None
        return stored

    async def put(self, tenant: str, stored: StoredResponse) -> None:
        path = self._path(tenant, stored.id)
        with _readable():
            await asyncio.to_thread(write_atomically, path, stored.to_bytes())
        self._puts += 1
        if self._puts % _PRUNE_EVERY == 0:  # a folder scan per put would cost more than the put
            await asyncio.to_thread(prune_folder, path.parent, TTL_S, MAX_PER_TENANT)

    async def delete(self, tenant: str, response_id: str) -> bool:
        with _readable():
            return await asyncio.to_thread(remove, self._path(tenant, response_id))

    async def touch(self, tenant: str, response_ids: list[str]) -> None:
        with _readable():
            await asyncio.to_thread(_touch, [self._path(tenant, r) for r in response_ids])

    async def erase_sessions(self, tenant: str, sessions: set[str]) -> int:
        with _readable():
            return await asyncio.to_thread(remove_matching, self.root / safe_name(tenant),
                                             lambda raw: StoredResponse.from_bytes(raw).session_id in sessions)

    async def close(self) -> None:
        return None


@contextmanager
def _readable() -> Iterator[None]:
    """A store folder that cannot be read or written: a 503 the client may retry, as with Redis down."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as e:
        raise GatewayError(ErrorKind.UNAVAILABLE, f"the response store is unavailable: {e.strerror or e}",
                           code="store_unavailable") from None


def _touch(paths: list[Path]) -> None:
    """Newer modification times: the files' pruning drops the oldest first."""
    for path in paths:
        try:
            os.utime(path)
        except FileNotFoundError:
            continue


class _Redis:
    def __init__(self, url: str) -> None:
        self._target = RedisTarget.parse(url)
        self._redis = self._target.async_client()

    def _key(self, tenant: str, response_id: str) -> str:
        # The id is the client's to choose: hashed, it cannot reach into another tenant's keys.
        return f"ctxgate:resp:{self._target.tag(tenant)}{tenant}:{xxhash.xxh3_128_hexdigest(response_id.encode())}"

    def _index(self, tenant: str) -> str:
        """On a cluster, the tenant's hash tag puts it on the slot of the keys it lists."""
        return f"ctxgate:resp-index:{self._target.tag(tenant)}{tenant}"

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with reachable():
            raw = await self._redis.get(self._key(tenant, response_id))
        return StoredResponse.from_bytes(raw) if raw else None

    async def put(self, tenant: str, stored: StoredResponse) -> None:
        name, index = self._key(tenant, stored.id), self._index(tenant)
        with reachable():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(name, stored.to_bytes(), ex=TTL_S)
                pipe.zadd(index, {name: stored.created_at})
                pipe.expire(index, TTL_S)
                await pipe.execute()
            overflow = await self._redis.zcard(index) - MAX_PER_TENANT
            if overflow > 0:
                oldest = await self._redis.zrange(index, 0, overflow - 1)
                if oldest:
                    await self._redis.delete(*oldest)
                    await self._redis.zrem(index, *oldest)

    async def delete(self, tenant: str, response_id: str) -> bool:
        name = self._key(tenant, response_id)
        with reachable():
            removed = await self._redis.delete(name)
            await self._redis.zrem(self._index(tenant), name)
        return bool(removed)

    async def touch(self, tenant: str, response_ids: list[str]) -> None:
        now = time.time()
        names = [self._key(tenant, r) for r in response_ids]
        with reachable():
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zadd(self._index(tenant), {name: now for name in names}, xx=True)
                for name in names:
                    pipe.expire(name, TTL_S)
                await pipe.execute()

    async def erase_sessions(self, tenant: str, sessions: set[str]) -> int:
        with reachable():
            return await erase_matching(self._redis, self._index(tenant),
                                        lambda raw: StoredResponse.from_bytes(raw).session_id in sessions)

    async def close(self) -> None:
        await self._redis.aclose()


def open_response_store(state_url: str, data_dir: Path) -> ResponseStore:
    backend: _Backend = _Files(data_dir / "responses") if state_url == "memory" else _Redis(state_url)
    return ResponseStore(backend)
