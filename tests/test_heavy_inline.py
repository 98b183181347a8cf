"""A large body of few messages is checked and fingerprinted on the event loop's thread (its
work costs less than a thread hop); many messages, or a body past a megabyte, in a thread, in
the tenant's slots (proxy/heavy.py, proxy/engine/off_loop.py)."""
from __future__ import annotations

import asyncio
import threading

from ctxgate.proxy.engine.off_loop import HEAVY_MESSAGES, INLINE_INDEX_BYTES, index_inline
from ctxgate.proxy.heavy import FEW_ITEMS, FEW_ITEMS_BYTES, HEAVY_BODY_BYTES, HeavyWork


def where(body_bytes: int, items: int | None) -> str:
    async def run() -> str:
        loop_thread = threading.get_ident()
        ran = await HeavyWork().run("acme", 1, body_bytes, threading.get_ident, items)
        return "inline" if ran == loop_thread else "thread"

    return asyncio.run(run())


def test_few_messages_in_a_large_body_stay_inline_many_or_a_megabyte_go_to_a_thread() -> None:
    assert where(HEAVY_BODY_BYTES - 1, None) == "inline"
    assert where(HEAVY_BODY_BYTES, None) == "thread"  # the door does not know its messages
    assert where(426_000, 337) == "inline"  # a new 107K-token conversation
    assert where(426_000, FEW_ITEMS) == "thread"
    assert where(FEW_ITEMS_BYTES, 10) == "thread"


def test_fingerprints_inline_below_the_same_bounds() -> None:
    assert index_inline(337, 426_000)
    assert not index_inline(HEAVY_MESSAGES, 426_000)
    assert not index_inline(10, INLINE_INDEX_BYTES)
