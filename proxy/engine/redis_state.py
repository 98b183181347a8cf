"""Session state in Redis, saved as a delta.

A state's bulk is its compaction records (compacted message lists, often 10-100 KB each)
and a few other large fields that change only when a compaction or a memory refresh
happens; a steady turn changes a few counters. So the main value holds the small fields
and names where the large parts are: each record under its own key, written once when the
record is new, and each other large part under a key named by a digest of its content,
written when the field holds a new object with other content. Both rest on one rule the
engine keeps: records, and these fields' values, are replaced, never changed in place
(a change in place would not be saved). A save writes the new parts, the main value and an
EXPIRE for each kept part in one Lua script (atomic, as MULTI/EXEC would be; redis-py's
cluster client runs a MULTI/EXEC through a thread of its own, a script in one call): the
main value never names a part that is not there, whatever fails.

A save made under the session's lock is fenced by it: the script writes only while the lock
still holds this process's token. A replica cut off from Redis past its lease,
whose session another replica has carried on meanwhile, cannot write its stale state over
the newer one; its turn ends in a 503. On a Redis Cluster every key of a session carries the
session's hash tag, so the save, its fence and the lock stay on one slot.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator

import orjson

from ctxgate.redis_backend import RedisTarget
from ctxgate.wal.backend import Fence
from ..errors import ErrorKind, GatewayError
from .redis_lock import LEASE_S, lease_lost, leased, leased_if_free
from .state import CompactionRecord, SessionState, reachable

log = logging.getLogger("ctxgate.state")

BLOB_PARTS = ("speculative", "compaction_log", "memory_block", "expanded")
"""The large fields other than `records` that a steady turn leaves alone."""
PARTS = "parts"
"""The main value's field naming the part keys: {"records": [key, ...], name: key or ""}."""
SPECULATION_RESULT_TTL_S = 3600
"""A published background compaction waits this long for the turn that needs it (the
session's next trigger); one that stale is dropped by its prefix hash anyway."""
SPECULATION_POLL_S = 0.05
SMALL_FIELDS = tuple(f.name for f in fields(SessionState) if f.name not in ("records", *BLOB_PARTS))


@dataclass
class _InRedis:
    """What Redis holds for one live state object, as it was loaded or last saved."""
    parts: dict[str, Any] = field(default_factory=lambda: {"records": []})
    """The main value's `parts`."""
    values: dict[str, Any] = field(default_factory=dict)
    """The blob parts' objects then: a field still holding its object is unchanged, known
    without serialising it."""


class RedisSessionStore:
    """State in Redis (main value plus part keys); a Redis lock per session across replicas."""

    def __init__(self, url: str, ttl_s: int = 7 * 24 * 3600, lock_timeout_s: float = 120.0,
                 lock_lease_s: float = LEASE_S) -> None:
        self._target = RedisTarget.parse(url)
        self._url = url
        self._redis = self._target.async_client()
        self._ttl = ttl_s
        self._lock_timeout = lock_timeout_s
        """How long a request waits for the session's lock before it is refused (session_busy)."""
        self._lock_lease = lock_lease_s
        """A replica killed mid-turn (during an Autocompact call, say) keeps the session from
        the others at most this long."""
        self._stored: dict[int, _InRedis] = {}
        """By `id(state)`: what Redis already holds, so a save writes only what is not."""
        self._held: dict[tuple[str, str], Any] = {}
        """The session locks this process holds now: what fences a save."""
        self._save_script = self._redis.register_script(_SAVE)

    def _key(self, tenant: str, session_id: str) -> str:
        return f"ctxgate:session:{self._target.tag(tenant, session_id)}{tenant}:{session_id}"

    @asynccontextmanager
    async def lock(self, tenant: str, session_id: str) -> AsyncIterator[None]:
        def busy() -> GatewayError:
            return GatewayError(ErrorKind.UNAVAILABLE, f"session {session_id} is busy with another request; retry "
                                "later", code="session_busy")

        async with leased(self._redis, self._key(tenant, session_id) + ":lock", self._lock_timeout, busy,
                          self._lock_lease) as held:
            self._held[(tenant, session_id)] = held
            try:
                yield
            finally:
                self._held.pop((tenant, session_id), None)

    async def load(self, tenant: str, session_id: str) -> SessionState | None:
        with reachable():
            raw = await self._redis.get(self._key(tenant, session_id))
            if not raw:
                return None
            main = orjson.loads(raw)
            parts: dict[str, Any] | None = main.pop(PARTS, None)
            if parts is None:  # saved whole, before parts: the next save writes it as parts
                return self._remember(SessionState.from_dict(main), {"records": []})
            names = [name for name in BLOB_PARTS if parts.get(name)]
            keys = parts["records"] + [parts[name] for name in names]
            values = await self._redis.mget(keys) if keys else []
        records, blobs = values[:len(parts["records"])], values[len(parts["records"]):]
        main["records"] = [orjson.loads(r) for r in records if r is not None]
        if len(main["records"]) < len(records):  # only if Redis itself evicted keys (maxmemory)
            log.warning("session %s/%s: %d compaction records were missing from Redis", tenant, session_id,
                        len(records) - len(main["records"]))
            parts["records"] = [k for k, r in zip(parts["records"], records) if r is not None]
        for name, blob in zip(names, blobs):
            if blob is not None:
                main[name] = orjson.loads(blob)
            else:
                parts[name] = ""
        return self._remember(SessionState.from_dict(main), parts)

    async def save(self, state: SessionState) -> None:
        state.updated_at = time.time()
        base = self._key(*state.key)
        stored = self._stored.get(id(state), _InRedis())
        parts: dict[str, Any] = {"records": [self._record_key(base, r) for r in state.records]}
        writes: dict[str, bytes] = {}
        known = set(stored.parts["records"])
        for key, record in zip(parts["records"], state.records):
            if key not in known:
                writes[key] = orjson.dumps(record)
        for name in BLOB_PARTS:
            value = getattr(state, name)
            if name in stored.values and value is stored.values[name]:
                parts[name] = stored.parts[name]
                continue
            raw = orjson.dumps(value) if value else b""
            parts[name] = f"{base}:{name}:{hashlib.blake2b(raw, digest_size=8).hexdigest()}" if raw else ""
            if parts[name] and parts[name] != stored.parts.get(name):
                writes[parts[name]] = raw
        main = {name: getattr(state, name) for name in SMALL_FIELDS}
        main[PARTS] = parts
        kept = {k for k in _part_keys(parts) if k not in writes}
        dropped = _part_keys(stored.parts) - kept - writes.keys()
        held = self._held.get(state.key)
        with reachable():
            tag = self._target.tag(*state.key)
            saved = await self._save_script(
                keys=[base + ":lock", base, _listing(tag), _listing(tag, state.tenant), *writes, *kept, *dropped],
                args=[held.local.token if held is not None else b"", self._ttl, len(writes), len(kept),
                      orjson.dumps(main), orjson.dumps(list(state.key)), state.updated_at, *writes.values()])
        if not saved:  # the lock changed hands: another replica holds the session now
            raise lease_lost(*state.key)
        self._remember(state, parts)

    @asynccontextmanager
    async def speculating(self, tenant: str, session_id: str) -> AsyncIterator[bool]:
        async with leased_if_free(self._redis, self._key(tenant, session_id) + ":speculation",
                                  self._lock_lease) as mine:
            yield mine

    async def publish_speculation(self, tenant: str, session_id: str, result: dict[str, Any]) -> None:
        with reachable():
            await self._redis.set(self._key(tenant, session_id) + ":speculation:result", orjson.dumps(result),
                                  ex=SPECULATION_RESULT_TTL_S)

    async def speculation_result(self, tenant: str, session_id: str, prefix_hash: str,
                                 wait_s: float) -> dict[str, Any] | None:
        claim = self._key(tenant, session_id) + ":speculation"
        deadline = time.monotonic() + wait_s
        with reachable():
            while True:
                running = await self._redis.exists(claim)
                raw = await self._redis.get(claim + ":result")  # after: one published before a release is seen
                found: dict[str, Any] | None = orjson.loads(raw) if raw is not None else None
                if found is not None and found.get("prefix_hash") == prefix_hash:
                    return found
                if not running or time.monotonic() > deadline:
                    return None  # an earlier speculation's result, or none: nobody runs this one
                await asyncio.sleep(SPECULATION_POLL_S)

    def fence(self, state: SessionState) -> Fence | None:
        held = self._held.get(state.key)
        return None if held is None else Fence(self._url, held.name, held.local.token)

    async def confirm(self, state: SessionState) -> None:
        held = self._held.get(state.key)
        if held is not None:
            with reachable():
                owner = await self._redis.get(held.name)
            if owner != held.local.token:
                raise lease_lost(*state.key)

    def _remember(self, state: SessionState, parts: dict[str, Any]) -> SessionState:
        if id(state) not in self._stored:
            weakref.finalize(state, self._stored.pop, id(state), None)
        self._stored[id(state)] = _InRedis(parts, {name: getattr(state, name) for name in BLOB_PARTS if name in parts})
        return state

    @staticmethod
    def _record_key(base: str, record: CompactionRecord) -> str:
        """Names a record by what makes it unique without reading its messages (which would
        cost a serialisation of every record on every save)."""
        return f"{base}:record:{record.prefix_len}:{record.prefix_hash}:{record.created_at!r}"

    async def list(self, tenant: str | None = None, limit: int | None = None) -> list[SessionState]:
        """The most recently saved first, from the listings each save keeps (a sorted set per
        shard: one on one node, 256 on a cluster, read in one pipeline), not from a SCAN. A
        session whose state expired leaves its listing when it is next read."""
        keys = [_listing(tag, tenant) if tenant is not None else _listing(tag) for tag in self._target.shard_tags()]
        end = -1 if limit is None else limit - 1
        with reachable():
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.zrevrange(key, 0, end, withscores=True)
                shards = await pipe.execute()
        named = sorted(((score, member, key) for key, found in zip(keys, shards) for member, score in found),
                       key=lambda x: -x[0])
        found: list[SessionState] = []
        for _, member, key in named[:limit]:
            t, s = orjson.loads(member)
            state = await self.load(t, s)
            if state is not None:
                found.append(state)
            else:
                with reachable():
                    await self._redis.zrem(key, member)
        return found

    async def forget(self, tenant: str, session_id: str) -> None:
        """Each `load` is a fresh copy: what a failed change touched was never saved."""

    async def erase(self, tenant: str, session_id: str) -> bool:
        """The main value, every part it names, a published background compaction, and its
        places in the listings."""
        base = self._key(tenant, session_id)
        tag = self._target.tag(tenant, session_id)
        with reachable():
            raw = await self._redis.get(base)
            parts = _part_keys(orjson.loads(raw).get(PARTS) or {"records": []}) if raw else set()
            member = orjson.dumps([tenant, session_id])
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.delete(base, base + ":speculation:result", *parts)
                pipe.zrem(_listing(tag), member)
                pipe.zrem(_listing(tag, tenant), member)
                await pipe.execute()
        return raw is not None

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except Exception:
            return False

    async def close(self) -> None:
        await self._redis.aclose()


_SAVE = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local ttl, written, kept = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 1, written do redis.call('SET', KEYS[4 + i], ARGV[7 + i], 'EX', ttl) end
redis.call('SET', KEYS[2], ARGV[5], 'EX', ttl)
for i = 5 + written, 4 + written + kept do redis.call('EXPIRE', KEYS[i], ttl) end
for i = 5 + written + kept, #KEYS do redis.call('DEL', KEYS[i]) end
for k = 3, 4 do
  redis.call('ZADD', KEYS[k], ARGV[7], ARGV[6])
  redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', tonumber(ARGV[7]) - ttl)
  redis.call('EXPIRE', KEYS[k], ttl)
end
return 1
"""
"""KEYS: the session's lock, its main value, the two listings it belongs to (every tenant's
and its tenant's, of its shard), then the parts written, kept and dropped. ARGV: the lock's
token (empty: a save outside the lock, as recovery's), the TTL, how many parts are written
and kept, the main value, the session's name in the listings and its time, then the written
parts' values. Returns 0, writing nothing, when the lock is not the token's. A listing drops
what expired with the TTL."""

def _listing(tag: str, tenant: str | None = None) -> str:
    """The sessions of one shard by the time they were saved: every tenant's, or one tenant's."""
    name = f"ctxgate:sessions:{tag}" if tag else "ctxgate:sessions"
    return name if tenant is None else f"{name}:tenant:{tenant}"


def _part_keys(parts: dict[str, Any]) -> set[str]:
    return set(parts["records"]) | {parts[name] for name in BLOB_PARTS if parts.get(name)}
