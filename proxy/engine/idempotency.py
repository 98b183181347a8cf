"""`Idempotency-Key`: a retried request whose upstream call already completed is answered
from the stored reply, without a second upstream call.

Replies are kept per tenant, for `wal.idempotency_ttl_s` and at most
`wal.idempotency_max_per_tenant` of them (the oldest go first): as files under the data
directory (they survive a crash, like the WAL) or in Redis when the state is there.
The same key with a different body is refused (422), as payment APIs do. A retry that
races its original waits for it: in the process with files, across every replica sharing
the Redis with Redis (a lease, `redis_lock.py`).
"""
from __future__ import annotations

import asyncio
import base64
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, AsyncContextManager, AsyncIterator, Callable, Protocol

import orjson
import xxhash

from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.redis_backend import RedisTarget
from ctxgate.redis_backend.indexed import erase_matching
from ctxgate.wal.archive import prune_folder, remove_matching, write_atomically
from ctxgate.wal.paths import safe_name
from ..errors import ErrorKind, GatewayError
from .redis_lock import leased
from .state import reachable

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255


@dataclass
class StoredReply:
    request_hash: str
    status: int
    content_type: str
    body: bytes
    headers: dict[str, str]
    created_at: float

    def to_bytes(self) -> bytes:
        return orjson.dumps({**asdict(self), "body": base64.b64encode(self.body).decode()})

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> "StoredReply":
        data = orjson.loads(raw)
        data["body"] = base64.b64decode(data["body"])
        return cls(**data)

    @property
    def session(self) -> str | None:
        return self.headers.get("X-Ctx-Session")


def key_of(headers: Any) -> str | None:
    key = headers.get(HEADER)
    if key is None:
        return None
    if not key or len(key) > MAX_KEY_LENGTH:
        raise GatewayError(ErrorKind.INVALID_REQUEST,
                           f"{HEADER} must be 1 to {MAX_KEY_LENGTH} characters", param=HEADER,
                       code="invalid_idempotency_key")
    return key


def request_hash(body: dict[str, Any]) -> str:
    return message_fingerprint(body)  # the canonical JSON hash messages are named by


class KeyLock(Protocol):
    def hold(self, tenant: str, key: str) -> AsyncContextManager[None]: ...


class IdempotencyStore(Protocol):
    @property
    def in_flight(self) -> KeyLock:
        """Held by a request from its stored-reply lookup to its reply's storing."""
    async def get(self, tenant: str, key: str) -> StoredReply | None: ...
    async def put(self, tenant: str, key: str, reply: StoredReply) -> None: ...
    async def erase_sessions(self, tenant: str, sessions: set[str]) -> int:
        """Drop the tenant's stored replies of these sessions (their `X-Ctx-Session`); how many."""
        ...


class _InFlight:
    """One request per key at a time in this process: a retry racing the original waits for it."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}
        """The lock of each key, and how many requests hold or wait for it."""

    @asynccontextmanager
    async def hold(self, tenant: str, key: str) -> AsyncIterator[None]:
        # Counted, not `lock.locked()`: a waiter being woken does not hold it yet, and
        # dropping the lock then would let a third request run beside it.
        lock, users = self._locks.get((tenant, key), (asyncio.Lock(), 0))
        self._locks[(tenant, key)] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[(tenant, key)]
            if users == 1:
                del self._locks[(tenant, key)]
            else:
                self._locks[(tenant, key)] = (lock, users - 1)


class _RedisInFlight:
    """One request per key at a time across the replicas sharing the Redis: a retry that races
    its original on another replica waits for it, and is answered from its stored reply."""

    def __init__(self, redis: Any, key: Callable[[str, str], str]) -> None:
        self._redis = redis
        self._key = key

    @asynccontextmanager
    async def hold(self, tenant: str, key: str) -> AsyncIterator[None]:
        def busy() -> GatewayError:  # never: it waits as long as the original's replica lives
            return GatewayError(ErrorKind.UNAVAILABLE, f"{HEADER} {key!r} is in use", code="idempotency_key_busy")

        async with leased(self._redis, self._key(tenant, key) + ":lock", None, busy):
            yield


class FileIdempotencyStore:
    def __init__(self, root: Path, ttl_s: float, max_per_tenant: int) -> None:
        self.root, self._ttl, self._max = root, ttl_s, max_per_tenant
        self.in_flight = _InFlight()

    def _path(self, tenant: str, key: str) -> Path:
        return self.root / safe_name(tenant) / (xxhash.xxh3_128_hexdigest(key.encode()) + ".json")

    async def get(self, tenant: str, key: str) -> StoredReply | None:
        path = self._path(tenant, key)
        try:
            reply = StoredReply.from_bytes(path.read_bytes())
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None
        if time.time() - reply.created_at > self._ttl:
            path.unlink(missing_ok=True)
            return None
        return reply

    async def put(self, tenant: str, key: str, reply: StoredReply) -> None:
        path = self._path(tenant, key)
        await asyncio.to_thread(write_atomically, path, reply.to_bytes())
        await asyncio.to_thread(prune_folder, path.parent, self._ttl, self._max)

    async def erase_sessions(self, tenant: str, sessions: set[str]) -> int:
        return await asyncio.to_thread(remove_matching, self.root / safe_name(tenant),
                                     lambda raw: StoredReply.from_bytes(raw).session in sessions)


class RedisIdempotencyStore:
    def __init__(self, url: str, ttl_s: float, max_per_tenant: int) -> None:
        self._target = RedisTarget.parse(url)
        self._redis = self._target.async_client()
        self._ttl, self._max = int(ttl_s), max_per_tenant
        self.in_flight = _RedisInFlight(self._redis, self._key)

    def _index(self, tenant: str) -> str:
        """A tenant's keys by age; on a cluster they share the tenant's hash tag with it."""
        return f"ctxgate:idem:{self._target.tag(tenant)}{tenant}"

    def _key(self, tenant: str, key: str) -> str:
        return f"{self._index(tenant)}:{xxhash.xxh3_128_hexdigest(key.encode())}"

    async def get(self, tenant: str, key: str) -> StoredReply | None:
        with reachable():
            raw = await self._redis.get(self._key(tenant, key))
        return StoredReply.from_bytes(raw) if raw else None

    async def put(self, tenant: str, key: str, reply: StoredReply) -> None:
        name, index = self._key(tenant, key), self._index(tenant)
        with reachable():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(name, reply.to_bytes(), ex=self._ttl)
                pipe.zadd(index, {name: reply.created_at})
                pipe.expire(index, self._ttl)
                await pipe.execute()
            overflow = await self._redis.zcard(index) - self._max
            if overflow > 0:
                oldest = await self._redis.zrange(index, 0, overflow - 1)
                if oldest:
                    await self._redis.delete(*oldest)
                    await self._redis.zrem(index, *oldest)

    async def erase_sessions(self, tenant: str, sessions: set[str]) -> int:
        with reachable():
            return await erase_matching(self._redis, self._index(tenant),
                                        lambda raw: StoredReply.from_bytes(raw).session in sessions)

    async def close(self) -> None:
        await self._redis.aclose()


def open_idempotency_store(state_url: str, data_dir: Path, ttl_s: float, max_per_tenant: int) -> IdempotencyStore:
    if state_url == "memory":
        return FileIdempotencyStore(data_dir / "idempotency", ttl_s, max_per_tenant)
    return RedisIdempotencyStore(state_url, ttl_s, max_per_tenant)
