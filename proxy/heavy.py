"""CPU work of large requests, off the event loop and in fair shares.

Validating, reading and planning a conversation of hundreds of thousands of messages takes
seconds of Python. On the event loop it would hold every other request (and `/healthz`)
for all of it; in a thread the loop gets the GIL back every switch interval (`serve` sets
it to 1 ms), so it keeps answering while the work goes on. A small request stays inline: a
thread hop costs more than its work.

Each tenant runs at most `heavy_concurrency` such jobs at once (`TenantConfig`): its next
large request waits behind its own, while other tenants' work goes on.
"""
from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

T = TypeVar("T")

HEAVY_BODY_BYTES = 256 * 1024
"""A request body at least this large has its CPU work done in a thread (a quarter megabyte
of messages validates in a few milliseconds)."""
FEW_ITEMS = 1_000
"""Fewer messages than this, in a body under `FEW_ITEMS_BYTES`, are checked inline all the same:
their work is ~2.5 us a message and ~1 ms a megabyte (337 messages, 426 KB: ~1.3 ms), where a
thread hop on a busy machine waits 1-5 ms for the thread to be scheduled and as long for the
loop to be again."""
FEW_ITEMS_BYTES = 1024 * 1024


class HeavyWork:
    def __init__(self) -> None:
        self._slots: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}
        """Per tenant with work running or waiting: its slots, and how many hold or want one."""

    def heavy(self, body_bytes: int, items: int | None = None) -> bool:
        """`items`: the messages (or items) the body holds, when the door knows."""
        few = items is not None and items < FEW_ITEMS and body_bytes < FEW_ITEMS_BYTES
        return body_bytes >= HEAVY_BODY_BYTES and not few

    async def run(self, tenant: str, limit: int, body_bytes: int, work: Callable[[], T],
                  items: int | None = None) -> T:
        """`work()`: inline for a small request, else in a thread once one of the tenant's
        `limit` slots is free."""
        if not self.heavy(body_bytes, items):
            return work()
        slot, users = self._slots.setdefault(tenant, (asyncio.Semaphore(limit), [0]))
        users[0] += 1
        try:
            async with slot:
                return await asyncio.to_thread(work)
        finally:
            users[0] -= 1
            if not users[0]:  # an idle tenant keeps nothing: tenant names are open-ended
                del self._slots[tenant]
