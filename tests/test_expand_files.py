"""Originals kept in files beside the WAL (in-process session state): a gateway restarted
from its log still serves the references its notes name; the size cap and the age hold; a
reference of another tenant or session finds nothing."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from ctxgate.proxy.engine.content_files import FileContentStore


def test_originals_outlive_the_process_and_stay_within_their_bounds(tmp_path: Path) -> None:
    async def run() -> None:
        store = FileContentStore(tmp_path)
        await store.put("acme", "s1", {"aaa111": "the whole build log", "bbb222": "x" * 50}, 1000, 3600)
        again = FileContentStore(tmp_path)  # a new process, the same data directory
        assert await again.get("acme", "s1", "aaa111", 3600) == "the whole build log"
        assert await again.get("acme", "s2", "aaa111", 3600) is None  # another session
        assert await again.get("other", "s1", "aaa111", 3600) is None  # another tenant
        assert await again.get("acme", "s1", "../../etc", 3600) is None
        old = tmp_path / "content" / "acme" / "s1" / "aaa111"
        os.utime(old, (time.time() - 7200, time.time() - 7200))
        assert await again.get("acme", "s1", "aaa111", 3600) is None  # past its age
        await again.put("acme", "s1", {"ccc333": "y" * 60}, 100, 3600)  # the old one goes, then the oldest
        assert not old.exists()
        assert await again.get("acme", "s1", "bbb222", 3600) is None  # 50 + 60 > 100: the oldest left
        assert await again.get("acme", "s1", "ccc333", 3600) == "y" * 60

    asyncio.run(run())


def test_originals_past_their_age_go_even_from_sessions_that_never_write_again(tmp_path: Path) -> None:
    async def run() -> None:
        store = FileContentStore(tmp_path)
        await store.put("acme", "ended", {"aaa111": "old"}, 1000, 3600)
        await store.put("acme", "live", {"bbb222": "new", "ccc333": "old too"}, 1000, 3600)
        for path in (tmp_path / "content" / "acme" / "ended" / "aaa111", tmp_path / "content" / "acme" / "live" /
                     "ccc333"):
            os.utime(path, (time.time() - 7200, time.time() - 7200))
        assert await store.prune(3600) == 2
        assert not (tmp_path / "content" / "acme" / "ended").exists()
        assert await store.get("acme", "live", "bbb222", 3600) == "new"

    asyncio.run(run())
