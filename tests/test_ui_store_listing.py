"""Listing sessions for the dashboard: both stores list a tenant's sessions or every
tenant's, and listing changes nothing (no LRU place, no Redis TTL renewed)."""
from __future__ import annotations

import uuid
from typing import AsyncIterator

import pytest_asyncio
import redis

from ctxgate.proxy.engine.redis_state import RedisSessionStore
from ctxgate.proxy.engine.state import CompactionRecord, MemorySessionStore, SessionState
from servers import RedisServer


def _state(tenant: str, session: str) -> SessionState:
    state = SessionState(tenant, session, turns=3, answered_turns=2)
    state.add_record(CompactionRecord(prefix_len=4, prefix_hash="h4", messages=[{"role": "user", "content": "s"}],
                                      levels=["snip"], tokens_before=900, tokens_after=300, created_at=1.5))
    state.compaction_log = [{"level": "snip", "tokens_before": 900, "tokens_after": 300, "at": 1.5}]
    return state


@pytest_asyncio.fixture(loop_scope="function")
async def redis_store(redis_server: RedisServer) -> AsyncIterator[RedisSessionStore]:
    store = RedisSessionStore(redis_server.url)
    yield store
    await store.close()


async def test_the_memory_store_lists_by_tenant_without_renewing_anything() -> None:
    store = MemorySessionStore(max_sessions=2)
    await store.save(_state("a", "one"))
    await store.save(_state("b", "two"))
    assert [s.session_id for s in await store.list("a")] == ["one"]
    assert {s.key for s in await store.list()} == {("a", "one"), ("b", "two")}
    await store.save(_state("a", "three"))  # one too many: the least recently used goes, listing or not
    assert {s.key for s in await store.list()} == {("b", "two"), ("a", "three")}


async def test_the_redis_store_lists_main_values_only(redis_store: RedisSessionStore,
                                                      redis_server: RedisServer) -> None:
    tenant, other = "t-" + uuid.uuid4().hex[:8], "u-" + uuid.uuid4().hex[:8]
    for session in ("s:1", "s:2"):  # ':' is allowed in ids, and in the key beside it
        await redis_store.save(_state(tenant, session))
    await redis_store.save(_state(other, "s"))
    async with redis_store.lock(tenant, "s:1"):  # a lock key beside the values is not a session
        listed = await redis_store.list(tenant)
    assert sorted(s.session_id for s in listed) == ["s:1", "s:2"]
    assert all(s.answered_turns == 2 and s.records[0].tokens_after == 300 and s.compaction_log for s in listed)
    everyone = {s.key for s in await redis_store.list()}
    assert {(tenant, "s:1"), (tenant, "s:2"), (other, "s")} <= everyone

    conn = redis.Redis.from_url(redis_server.url)
    key = f"ctxgate:session:{other}:s"
    conn.expire(key, 100)
    await redis_store.list(other)
    assert conn.ttl(key) <= 100  # listing did not renew it


async def test_the_redis_listing_is_newest_first_limited_and_forgets_the_expired(
        redis_store: RedisSessionStore, redis_server: RedisServer) -> None:
    tenant = "t-" + uuid.uuid4().hex[:8]
    for session in ("s1", "s2", "s3"):
        await redis_store.save(_state(tenant, session))
    assert [s.session_id for s in await redis_store.list(tenant, 2)] == ["s3", "s2"]
    conn = redis.Redis.from_url(redis_server.url)
    conn.delete(f"ctxgate:session:{tenant}:s3")  # expired
    await redis_store.list(tenant, 2)
    assert [s.session_id for s in await redis_store.list(tenant, 2)] == ["s2", "s1"]
    assert conn.zscore(f"ctxgate:sessions:tenant:{tenant}", f'["{tenant}","s3"]') is None
