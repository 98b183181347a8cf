"""What a session's figures say and how long it stays in memory: turns are attempts,
answered turns are the ones the upstream answered; an in-memory session leaves memory when it
is idle or the least recently used, and its WAL brings it back when it returns."""
from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from clients import MESSAGES, client
from ctxgate.proxy.engine.state import MemorySessionStore, SessionState
from servers import KEYS, Gateway, launch, main_config, stop_all
from upstream import ScriptedUpstream

AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}


# -- the store, as a unit -------------------------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_idle_and_least_recently_used_sessions_leave_memory() -> None:
    async def run() -> None:
        clock = _Clock()
        store = MemorySessionStore(max_sessions=3, idle_ttl_s=60, clock=clock)
        for name in ("a", "b", "c"):
            await store.save(SessionState("t", name))
        assert await store.load("t", "a") is not None  # used: now the most recent
        await store.save(SessionState("t", "d"))  # one too many: b, the least recently used, goes
        assert len(store) == 3 and await store.load("t", "b") is None
        clock.now += 61
        async with store.lock("t", "c"):  # idle, and its lock held: the state goes, the lock stays
            await store.save(SessionState("t", "e"))
            assert len(store) == 1 and await store.load("t", "c") is None
            assert await store.load("t", "e") is not None

    asyncio.run(run())


# -- through the gateway ------------------------------------------------------------------

@pytest.fixture(scope="module")
def shortgw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto", session_idle_ttl_s=0.5)
    gw = launch("short-ttl", Path(tmp_path_factory.mktemp("short-ttl")), config).wait_ready()
    yield gw
    stop_all([gw])


def _summary(gw: Gateway, session: str) -> dict[str, Any]:
    status, summary = gw.get(f"/v1/ctx/sessions/{session}", AUTH)
    assert status == 200, summary
    return summary


def test_answered_turns_and_failed_attempts_are_told_apart(shortgw: Gateway, up: ScriptedUpstream) -> None:
    session = f"fig-{uuid.uuid4().hex[:8]}"
    cli = client(shortgw).with_options(max_retries=0)
    cli.chat.completions.create(model="gpt-4o", messages=MESSAGES, extra_headers={"X-Ctx-Session": session})
    with pytest.raises(openai.InternalServerError):
        cli.chat.completions.create(model="error-500", messages=[*MESSAGES, {"role": "assistant", "content": "ok"},
                                                                 {"role": "user", "content": "again"}],
                                    extra_headers={"X-Ctx-Session": session})
    summary = _summary(shortgw, session)
    assert (summary["turns"], summary["answered_turns"], summary["unanswered_turns"]) == (2, 1, 1)


def test_an_idle_session_leaves_memory_and_its_wal_brings_it_back(shortgw: Gateway, up: ScriptedUpstream) -> None:
    session = f"idle-{uuid.uuid4().hex[:8]}"
    cli = client(shortgw)
    messages = list(MESSAGES)
    for turn in range(2):
        messages += [{"role": "assistant", "content": f"a{turn}"}, {"role": "user", "content": f"u{turn}"}]
        cli.chat.completions.create(model="gpt-4o", messages=messages, extra_headers={"X-Ctx-Session": session})
    time.sleep(1.0)
    # Another session's save sweeps the idle one out of memory.
    cli.chat.completions.create(model="gpt-4o", messages=MESSAGES, extra_headers={"X-Ctx-Session": f"o-{session}"})
    recovered = f"session acme/{session} recovered from the WAL"
    assert recovered not in shortgw.text()
    summary = _summary(shortgw, session)  # read from its WAL: it is not in memory any more
    assert (summary["turns"], summary["answered_turns"]) == (2, 2)
    assert recovered in shortgw.text()
