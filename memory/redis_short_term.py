"""Short-term buffers in Redis, beside the session state: every replica feeds and drains the
same buffer, and a replica killed with -9 loses none of it.

Keys of one session (`{tag}` its hash tag on a cluster, empty on one node):

    ctxgate:memory:buffer:{tag}<t>:<s>           hash: the buffer's scope and times
    ctxgate:memory:buffer:{tag}<t>:<s>:entries   list: candidate JSON, oldest first
    ctxgate:memory:buffer:{tag}<t>:<s>:seen      sorted set: fingerprint -> order first seen
    ctxgate:memory:buffers[:{tag}]               sorted set: [t, s] -> last fed (one per shard)

Each operation is one Lua script on the session's slot, so two replicas feeding one session
never capture a message twice, and two draining it (an idle sweep on each) never both get
its candidates: one auto-dream per batch, whichever replica runs it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson

from ctxgate.redis_backend import RedisTarget
from .entries import Category
from .short_term import SEEN_LIMIT, Added, BufferScope, Candidate, SessionBuffer, SessionKey

_TTL_S = 7 * 24 * 3600
"""A buffer no replica feeds or ends (every replica gone for a week) expires."""
_LOCAL_SESSIONS = 1024
"""Sessions whose fingerprints this process remembers, to skip capture of what it fed itself."""

_ADD = """
local now, ttl, limit, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[9])
local first = redis.call('EXISTS', KEYS[1]) == 0
if first then redis.call('HSET', KEYS[1], 'last_dream_at', now, 'order', 0) end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'user', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'project', ARGV[6]) end
redis.call('HSET', KEYS[1], 'profile', ARGV[7], 'model', ARGV[8], 'last_seen_at', now)
local order = tonumber(redis.call('HGET', KEYS[1], 'order'))
local fresh = {}
for i = 1, n do
  if not redis.call('ZSCORE', KEYS[3], ARGV[9 + i]) then
    order = order + 1
    redis.call('ZADD', KEYS[3], order, ARGV[9 + i])
    fresh[i - 1] = true
  end
end
redis.call('HSET', KEYS[1], 'order', order)
for j = 10 + n, #ARGV, 2 do
  if fresh[tonumber(ARGV[j])] then redis.call('RPUSH', KEYS[2], ARGV[j + 1]) end
end
local over = redis.call('ZCARD', KEYS[3]) - limit
if over > 0 then redis.call('ZREMRANGEBYRANK', KEYS[3], 0, over - 1) end
redis.call('ZADD', KEYS[4], now, ARGV[4])
for k = 1, 4 do redis.call('EXPIRE', KEYS[k], ttl) end
return {first and 1 or 0, redis.call('LLEN', KEYS[2]), redis.call('HMGET', KEYS[1], 'user', 'project', 'last_dream_at')}
"""
"""KEYS: the buffer, its entries, its seen set, its shard's listing. ARGV: now, TTL, the seen
limit, the session's name in the listing, user, project (empty: keep), profile, model, how
many fingerprints, the fingerprints, then (message index, candidate JSON) pairs."""

_DRAIN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSET', KEYS[1], 'last_dream_at', ARGV[1])
local taken = redis.call('LRANGE', KEYS[2], 0, -1)
redis.call('DEL', KEYS[2])
return {redis.call('HMGET', KEYS[1], 'user', 'project', 'profile', 'model', 'last_seen_at', 'last_dream_at'), taken}
"""

_FORGET = """
local seen = redis.call('HGET', KEYS[1], 'last_seen_at')
if seen and tonumber(seen) > tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('ZREM', KEYS[4], ARGV[2])
return 1
"""


class RedisShortTermStore:
    def __init__(self, url: str, ttl_s: int = _TTL_S) -> None:
        self._target = RedisTarget.parse(url)
        self._redis = self._target.async_client()
        self._ttl = ttl_s
        self._add = self._redis.register_script(_ADD)
        self._drain = self._redis.register_script(_DRAIN)
        self._forget = self._redis.register_script(_FORGET)
        self._fed: OrderedDict[SessionKey, set[str]] = OrderedDict()
        """Fingerprints this process has put in Redis, per session (a subset of what Redis holds)."""

    def _keys(self, key: SessionKey) -> list[str]:
        tag = self._target.tag(*key)
        base = f"ctxgate:memory:buffer:{tag}{key[0]}:{key[1]}"
        return [base, base + ":entries", base + ":seen", _listing(tag)]

    async def add(self, key: SessionKey, scope: BufferScope, fingerprint_list: list[str],
                  found: list[tuple[int, Candidate]], now: float) -> Added:
        # Only what this process has not fed itself goes to Redis: a steady turn sends its new
        # messages' fingerprints, not the whole history's.
        todo = sorted(self.unseen(key, fingerprint_list))
        position = {i: p for p, i in enumerate(todo)}
        pairs: list[Any] = []
        for i, candidate in found:
            if i in position:
                pairs += [position[i], _dumps(candidate)]
        first, size, (user, project, last_dream_at) = await self._add(
            keys=self._keys(key),
            args=[repr(now), self._ttl, SEEN_LIMIT, _member(key), scope.user or "", scope.project or "",
                  scope.profile, scope.model or "", len(todo), *(fingerprint_list[i] for i in todo), *pairs])
        self._remember(key, fingerprint_list)
        buffer = SessionBuffer(key[0], _text(user), _text(project), scope.profile, scope.model, now,
                               float(last_dream_at))
        return Added(buffer, bool(first), int(size))

    def _remember(self, key: SessionKey, fingerprint_list: list[str]) -> None:
        fed = self._fed.pop(key, set())
        fed.update(fingerprint_list)
        if len(fed) > SEEN_LIMIT:
            fed = set(fingerprint_list)
        self._fed[key] = fed
        while len(self._fed) > _LOCAL_SESSIONS:
            self._fed.popitem(last=False)

    def unseen(self, key: SessionKey, fingerprint_list: list[str]) -> set[int]:
        fed = self._fed.get(key, set())
        return {i for i, fp in enumerate(fingerprint_list) if fp not in fed}

    async def peek(self, key: SessionKey) -> tuple[SessionBuffer | None, list[Candidate]]:
        base, entries, _, _ = self._keys(key)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hmget(base, "user", "project", "profile", "model", "last_seen_at", "last_dream_at")
            pipe.lrange(entries, 0, -1)
            fields, raw = await pipe.execute()
        if fields[4] is None:
            return None, []
        return _buffer(key, fields), [_loads(r) for r in raw]

    async def drain(self, key: SessionKey, now: float) -> tuple[SessionBuffer | None, list[Candidate]]:
        base, entries, _, _ = self._keys(key)
        found = await self._drain(keys=[base, entries], args=[repr(now)])
        if not found:
            return None, []
        fields, raw = found
        return _buffer(key, fields), [_loads(r) for r in raw]

    async def forget(self, key: SessionKey, seen_at: float) -> None:
        if await self._forget(keys=self._keys(key), args=[repr(seen_at), _member(key)]):
            self._fed.pop(key, None)

    async def idle(self, now: float, idle_s: float) -> list[SessionKey]:
        """From every shard's listing, in one pipeline."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for tag in self._target.shard_tags():
                pipe.zrangebyscore(_listing(tag), "-inf", repr(now - idle_s))
            shards = await pipe.execute()
        return [(t, s) for members in shards for t, s in map(orjson.loads, members)]

    async def left_at_close(self) -> list[SessionKey]:
        return []

    async def close(self) -> None:
        await self._redis.aclose()


def _listing(tag: str) -> str:
    return f"ctxgate:memory:buffers:{tag}" if tag else "ctxgate:memory:buffers"


def _member(key: SessionKey) -> bytes:
    return orjson.dumps(list(key))


def _text(value: bytes | None) -> str | None:
    return value.decode() if value else None


def _buffer(key: SessionKey, fields: list[bytes | None]) -> SessionBuffer:
    user, project, profile, model, seen_at, dream_at = fields
    return SessionBuffer(key[0], _text(user), _text(project), _text(profile) or "professional", _text(model),
                         float(seen_at or 0), float(dream_at or 0))


def _dumps(candidate: Candidate) -> bytes:
    return orjson.dumps({"category": candidate.category.value if candidate.category else None,
                         "content": candidate.content, "data": candidate.data, "captured_at": candidate.captured_at,
                         "source": candidate.source, "span": candidate.span, "turn": candidate.turn,
                         "door": candidate.door})


def _loads(raw: bytes) -> Candidate:
    item = orjson.loads(raw)
    category = Category(item["category"]) if item["category"] else None
    # Candidates buffered before provenance existed come back as scaffolding: never a
    # preference or a correction, only facts.
    return Candidate(category, item["content"], item["data"], item["captured_at"], item.get("source", "scaffolding"),
                     item.get("span", ""), item.get("turn"), item.get("door"))
