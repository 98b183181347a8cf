"""The short-term buffer stores, in this process and in a real Redis: what two replicas feeding
one session capture, what two draining it get, and when an ended session's buffer goes."""
from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable

import pytest

from ctxgate.memory.entries import Category
from ctxgate.memory.redis_short_term import RedisShortTermStore
from ctxgate.memory.short_term import BufferScope, Candidate, LocalShortTermStore, ShortTermStore

SCOPE = BufferScope("u1", "p1", "enterprise", "gpt-4o")


@pytest.fixture(params=["local", "redis"])
def replicas(request: pytest.FixtureRequest) -> Callable[[], ShortTermStore]:
    """Stores that share their buffers as two replicas would (in this process: one store)."""
    if request.param == "local":
        shared = LocalShortTermStore()
        return lambda: shared
    url = request.getfixturevalue("redis_server").url
    return lambda: RedisShortTermStore(url)


def _key() -> tuple[str, str]:
    return ("acme", "st-" + uuid.uuid4().hex[:8])


def _found(*pairs: tuple[int, str]) -> list[tuple[int, Candidate]]:
    return [(i, Candidate(Category.USER, text, {"source": "rule"}, 1.5)) for i, text in pairs]


async def _close(*stores: ShortTermStore) -> None:
    for store in {id(s): s for s in stores}.values():
        await store.close()


async def test_a_resent_history_is_captured_once_whichever_replica_sees_it(
        replicas: Callable[[], ShortTermStore]) -> None:
    a, b = replicas(), replicas()
    key = _key()
    first = await a.add(key, SCOPE, ["f0", "f1"], _found((1, "I prefer tabs.")), 10.0)
    assert first.first and first.size == 1 and first.buffer.last_dream_at == 10.0
    # b has fed nothing itself: it reads the whole history for candidates, and Redis keeps the new one only
    assert b.unseen(key, ["f0", "f1", "f2"]) in ({2}, {0, 1, 2})
    second = await b.add(key, SCOPE, ["f0", "f1", "f2"], _found((1, "I prefer tabs."), (2, "Always use rg.")), 11.0)
    assert not second.first and second.size == 2
    assert a.unseen(key, ["f0", "f1"]) == set()
    buffer, entries = await a.peek(key)
    assert buffer is not None and (buffer.user, buffer.project, buffer.profile) == ("u1", "p1", "enterprise")
    assert [(c.category, c.content, c.data, c.captured_at) for c in entries] == [
        (Category.USER, "I prefer tabs.", {"source": "rule"}, 1.5),
        (Category.USER, "Always use rg.", {"source": "rule"}, 1.5)]
    await _close(a, b)


async def test_two_replicas_draining_one_buffer_never_both_get_it(replicas: Callable[[], ShortTermStore]) -> None:
    a, b = replicas(), replicas()
    key = _key()
    await a.add(key, SCOPE, [f"f{i}" for i in range(30)], _found(*((i, f"rule {i}") for i in range(30))), 10.0)
    drained = await asyncio.gather(a.drain(key, 20.0), b.drain(key, 20.0), a.drain(key, 20.0))
    taken = sorted(len(entries) for _, entries in drained)
    assert taken == [0, 0, 30]
    buffer, left = await b.peek(key)
    assert buffer is not None and buffer.last_dream_at == 20.0 and left == []
    await _close(a, b)


async def test_an_ended_session_goes_unless_it_came_back(replicas: Callable[[], ShortTermStore]) -> None:
    a, b = replicas(), replicas()
    key = _key()
    await a.add(key, SCOPE, ["f0"], _found((0, "Reply in French.")), 10.0)
    seen_at = (await b.peek(key))[0]
    assert seen_at is not None and seen_at.last_seen_at == 10.0
    await a.add(key, SCOPE, ["f0", "f1"], [], 12.0)  # a turn while b was ending it
    await b.forget(key, seen_at.last_seen_at)
    buffer, entries = await a.peek(key)
    assert buffer is not None and [c.content for c in entries] == ["Reply in French."]
    await b.forget(key, 12.0)
    assert await a.peek(key) == (None, [])
    assert b.unseen(key, ["f0"]) == {0}  # a session that comes back is read afresh where it ended
    await _close(a, b)


async def test_idle_sessions_are_listed_by_their_last_turn(replicas: Callable[[], ShortTermStore]) -> None:
    a, b = replicas(), replicas()
    old, new = _key(), _key()
    await a.add(old, SCOPE, ["f0"], [], 1_000.0)
    await a.add(new, SCOPE, ["f0"], [], 1_900.0)
    idle = await b.idle(2_000.0, 500.0)
    assert old in idle and new not in idle
    await b.forget(old, 1_000.0)
    assert old not in await a.idle(2_000.0, 500.0)
    await _close(a, b)


async def test_an_unreachable_redis_raises_and_remembers_nothing() -> None:
    """The capture is retried on the next turn: a failed add leaves the messages unseen here."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    store = RedisShortTermStore("redis://127.0.0.1:1/0")
    key = _key()
    with pytest.raises(RedisConnectionError):
        await store.add(key, SCOPE, ["f0"], _found((0, "x")), 1.0)
    assert store.unseen(key, ["f0"]) == {0}
    await store.close()


async def test_a_buffer_that_expired_leaves_the_idle_listing_once_ended(redis_server: Any) -> None:
    """A buffer no replica fed for its TTL expires while other sessions keep the listing; its
    name in the listing goes when it is ended, and ending never removes a buffer that exists."""
    short, store = RedisShortTermStore(redis_server.url, ttl_s=1), RedisShortTermStore(redis_server.url)
    gone, alive = _key(), _key()
    await short.add(gone, SCOPE, ["f0"], _found((0, "Reply in French.")), 1_000.0)
    await store.add(alive, SCOPE, ["f0"], [], 1_000.0)
    await asyncio.sleep(2.2)
    assert {gone, alive} <= set(await store.idle(2_000.0, 500.0))
    assert await store.peek(gone) == (None, [])
    await store.forget(gone, 0.0)
    await store.forget(alive, 0.0)
    assert gone not in await store.idle(2_000.0, 500.0)
    assert (await store.peek(alive))[0] is not None and alive in await store.idle(2_000.0, 500.0)
    await short.close()
    await store.close()
