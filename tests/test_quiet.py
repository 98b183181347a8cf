"""Background work waits for the counts in flight (proxy/engine/quiet.py): memory's capture,
whose regular expressions hold the GIL, would slow every count's threads, and running beside a
new conversation's count on the workers held its reply back."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from ctxgate.memory.config import MemoryConfig
from ctxgate.memory.file_store import FileMemoryStore
from ctxgate.memory.manager import MemoryManager
from ctxgate.memory.short_term import BufferScope
from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.provenance import message_spans
from ctxgate.proxy.engine import quiet
from ctxgate.proxy.engine.quiet import Quiet


def test_work_waits_for_the_count_in_flight_and_starts_once_after_it() -> None:
    async def run() -> None:
        q, release, started = Quiet(), threading.Event(), []
        q.after_counts(lambda: started.append("idle"))
        assert started == ["idle"]  # nothing counted: at once

        def count() -> int:
            release.wait(30)
            return 7

        counting = asyncio.ensure_future(q.around(asyncio.to_thread(count)))
        while not q.counting:
            await asyncio.sleep(0)
        q.after_counts(lambda: started.append("after"))
        await asyncio.sleep(0.05)
        assert started == ["idle"]  # the count still runs
        release.set()
        assert await counting == 7
        assert started == ["idle", "after"] and q.counting == 0

    asyncio.run(run())


def test_work_waits_no_longer_than_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quiet, "MAX_WAIT_S", 0.01)

    async def run() -> None:
        q, release, started = Quiet(), threading.Event(), asyncio.Event()
        runs: list[str] = []

        def start() -> None:
            runs.append("started")
            started.set()

        counting = asyncio.ensure_future(q.around(asyncio.to_thread(release.wait, 30)))
        while not q.counting:
            await asyncio.sleep(0)
        q.after_counts(start)
        await asyncio.wait_for(started.wait(), 30)  # started while the count still runs
        assert q.counting == 1
        release.set()
        await counting
        assert runs == ["started"]  # not again when the count ends

    asyncio.run(run())


def test_work_running_in_a_thread_waits_between_its_steps_while_a_count_runs() -> None:
    async def run() -> None:
        q, release, steps = Quiet(), threading.Event(), []
        counting = asyncio.ensure_future(q.around(asyncio.to_thread(release.wait, 30)))
        while not q.counting:
            await asyncio.sleep(0)
        pause = q.pauser()

        def work() -> None:
            steps.append("first")
            pause()  # waits here: the count still runs
            steps.append("second")

        worker = threading.Thread(target=work)
        worker.start()
        while not steps:
            await asyncio.sleep(0)
        worker.join(0.05)
        assert worker.is_alive() and steps == ["first"]
        release.set()
        await counting
        await asyncio.to_thread(worker.join, 30)
        assert steps == ["first", "second"]
        pause()  # nothing counted: returns at once
    asyncio.run(run())


def test_paused_work_goes_on_after_its_bound_however_long_counts_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quiet, "MAX_WAIT_S", 0.01)

    async def run() -> None:
        q, release = Quiet(), threading.Event()
        counting = asyncio.ensure_future(q.around(asyncio.to_thread(release.wait, 30)))
        while not q.counting:
            await asyncio.sleep(0)
        pause = q.pauser()
        await asyncio.wait_for(asyncio.to_thread(lambda: [pause() for _ in range(3)]), 30)
        assert q.counting == 1  # the count still runs; the work went on without it
        release.set()
        await counting
    asyncio.run(run())


def test_captures_paused_for_a_count_leave_the_thread_pool_to_the_turns(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Long captures read in threads pause while the gateway counts; a turn that needs a thread
    of the default pool meanwhile (its WAL lines) still gets one, however many wait."""
    async def summarize(model: str, messages: list[dict[str, Any]]) -> str:
        return "unused"

    async def dreamt(key: Any, event: dict[str, Any]) -> None:
        return None

    monkeypatch.setattr(quiet, "MAX_WAIT_S", 120.0)  # they wait for the count, however long

    async def run() -> int:
        q, release = Quiet(), threading.Event()
        manager = MemoryManager(FileMemoryStore(tmp_path), MemoryConfig(), summarize, dreamt, pauser=q.pauser)
        counting = asyncio.ensure_future(q.around(asyncio.to_thread(release.wait, 60)))
        while not q.counting:
            await asyncio.sleep(0)
        for i in range(12):  # more than the default pool's threads (cores + 4)
            messages = [{"role": "user", "content": f"session {i}: " + "We use pytest for tests. " * 2000}]
            manager.observe(("t", f"s{i}"), BufferScope(None, "p1", "professional", None), messages,
                            [message_fingerprint(m) for m in messages], lambda text, tokens: text,
                            lambda unseen, m=messages: message_spans(m, unseen))
        await asyncio.sleep(0.05)
        answered = await asyncio.wait_for(asyncio.to_thread(lambda: 7), 20)
        release.set()
        await counting
        await manager.idle_tasks()
        await manager.close()
        return answered

    assert asyncio.run(run()) == 7
