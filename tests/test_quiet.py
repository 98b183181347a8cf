"""Background work waits for the counts in flight (proxy/engine/quiet.py): memory's capture,
whose regular expressions hold the GIL, would slow every count's threads."""
from __future__ import annotations

import asyncio
import threading

import pytest

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
