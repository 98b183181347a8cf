"""The long-term store in Redis, shared by every replica.

Keys of one tenant (`t` is the tenant through `safe_name`, in braces: a Redis Cluster hash
tag, so all of a tenant's keys sit in one slot and a script may touch them together):

    <prefix>:{t}:<category>   hash: entry id -> entry JSON (one hash per category)
    <prefix>:{t}:expiry       sorted set: entry id -> expires_at (entries that expire)
    <prefix>:{t}:version      counter, INCR'd by every write

Every write is one Lua script, so a put that moves an entry to another category, or a
purge, is atomic for every replica. Reads are served from an in-process TenantView
(memory/ranking.py), rebuilt when the shared version moved: a read costs one GET until
some replica writes.

Redis unreachable or too slow, or no pooled connection free within the timeout: calls
raise `redis.exceptions.ConnectionError` or `redis.exceptions.TimeoutError` (both
`redis.exceptions.RedisError`, neither a builtin ConnectionError), or on a cluster failing
over one of redis-py's cluster errors: `redis_backend.UNAVAILABLE` lists them all, and the
gateway's `reachable()` maps them to 503.
"""
from __future__ import annotations

import asyncio
import builtins

import orjson
import redis.asyncio as redis

from ctxgate.redis_backend import RedisTarget
from ctxgate.wal.paths import safe_name
from .entries import Category, MemoryEntry
from .ranking import TenantView

# KEYS: the four category hashes, the expiry set, the version; ARGV: target category
# index (1-based), id, JSON, expires_at or "". The id leaves every other category first.
_PUT = """
local target = tonumber(ARGV[1])
for i = 1, 4 do
  if i ~= target then redis.call('HDEL', KEYS[i], ARGV[2]) end
end
redis.call('HSET', KEYS[target], ARGV[2], ARGV[3])
if ARGV[4] == '' then redis.call('ZREM', KEYS[5], ARGV[2]) else redis.call('ZADD', KEYS[5], ARGV[4], ARGV[2]) end
return redis.call('INCR', KEYS[6])
"""

# KEYS as above; ARGV: ids to delete. Returns how many existed.
_DELETE = """
local removed = 0
for _, id in ipairs(ARGV) do
  local found = 0
  for i = 1, 4 do found = found + redis.call('HDEL', KEYS[i], id) end
  redis.call('ZREM', KEYS[5], id)
  if found > 0 then removed = removed + 1 end
end
if removed > 0 then redis.call('INCR', KEYS[6]) end
return removed
"""

# KEYS as above; ARGV: now. Deletes what expired by `now`, in the script, so an entry
# replaced meanwhile by a lasting one is not touched.
_PURGE = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', ARGV[1])
for _, id in ipairs(gone) do
  for i = 1, 4 do redis.call('HDEL', KEYS[i], id) end
  redis.call('ZREM', KEYS[5], id)
end
if #gone > 0 then redis.call('INCR', KEYS[6]) end
return #gone
"""

_CATEGORIES = tuple(Category)


class RedisMemoryStore:
    def __init__(self, url: str, prefix: str = "ctxgate:mem", timeout_s: float = 5.0,
                 max_connections: int = 64) -> None:
        # A blocking pool: past `max_connections` concurrent calls wait for a connection
        # instead of failing at once (the default pool raises MaxConnectionsError); timeouts
        # bound a partitioned Redis, so the request gets a 503, not a hung socket.
        # On a cluster: redis-py's cluster client, `max_connections` per node.
        target = RedisTarget.parse(url)
        if target.cluster:
            self._redis = target.async_client(max_connections=max_connections, socket_timeout=timeout_s,
                                              socket_connect_timeout=timeout_s)
        else:
            pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout_s,
                                                         socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            self._redis = redis.Redis.from_pool(pool)
        self._prefix = prefix
        self._put = self._redis.register_script(_PUT)
        self._delete = self._redis.register_script(_DELETE)
        self._purge = self._redis.register_script(_PURGE)
        self._views: dict[str, TenantView] = {}
        self._rebuilding: dict[str, asyncio.Lock] = {}

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self._prefix}:{{{safe_name(tenant)}}}"
        return [f"{base}:{c.value}" for c in _CATEGORIES] + [f"{base}:expiry", f"{base}:version"]

    async def _view(self, tenant: str) -> TenantView:
        keys = self._keys(tenant)
        version = int(await self._redis.get(keys[5]) or 0)
        view = self._views.get(tenant)
        if view is not None and view.version == version:
            return view
        # One rebuild per tenant at a time: concurrent requests after a write share it.
        async with self._rebuilding.setdefault(tenant, asyncio.Lock()):
            view = self._views.get(tenant)
            if view is not None and view.version == version:
                return view
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.get(keys[5])
                for key in keys[:4]:
                    pipe.hvals(key)
                got = await pipe.execute()
            # Straight from JSON bytes: a third of the time of orjson.loads + model_validate.
            entries = [MemoryEntry.model_validate_json(raw) for values in got[1:] for raw in values]
            view = self._views[tenant] = TenantView(int(got[0] or 0), entries)
            return view

    async def put(self, entry: MemoryEntry) -> None:
        expires = "" if entry.expires_at is None else repr(entry.expires_at)
        await self._put(keys=self._keys(entry.tenant),
                        args=[_CATEGORIES.index(entry.category) + 1, entry.id,
                              orjson.dumps(entry.model_dump(mode="json")), expires])

    async def get(self, tenant: str, entry_id: str) -> MemoryEntry | None:
        return (await self._view(tenant)).entries.get(entry_id)

    async def delete(self, tenant: str, entry_id: str) -> bool:
        return bool(await self._delete(keys=self._keys(tenant), args=[entry_id]))

    async def list(self, tenant: str, category: Category | None = None,
                   now: float | None = None) -> builtins.list[MemoryEntry]:
        entries = (await self._view(tenant)).entries.values()
        return sorted((e for e in entries if (category is None or e.category == category)
                       and (now is None or not e.expired(now))), key=lambda e: (e.created_at, e.id))

    async def search(self, tenant: str, query: str, categories: tuple[Category, ...], user: str | None,
                     project: str | None, limit: int, now: float) -> builtins.list[tuple[MemoryEntry, float]]:
        return (await self._view(tenant)).search(query, categories, user, project, limit, now)

    async def version(self, tenant: str) -> int:
        return int(await self._redis.get(self._keys(tenant)[5]) or 0)

    async def purge_expired(self, tenant: str, now: float) -> int:
        return int(await self._purge(keys=self._keys(tenant), args=[repr(now)]))

    async def close(self) -> None:
        await self._redis.aclose()
