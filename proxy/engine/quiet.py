"""Counts first, background work after.

A turn's count runs in a thread that gives the GIL up while tiktoken encodes and takes it
back after every text: a thread that holds the GIL meanwhile (memory's capture, regular expressions
over every new message) makes each of those returns wait a switch interval. A 107K-token count
took 59 ms beside a capture instead of 38 alone. So work done for later turns waits while
this process counts, up to `MAX_WAIT_S`.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

MAX_WAIT_S = 2.0
"""The longest background work waits for counts that keep coming."""


class Quiet:
    """The counts in flight in this process, and the work waiting for none to be."""

    def __init__(self) -> None:
        self.counting = 0
        self._waiting: list[Callable[[], None]] = []

    async def around(self, counting: Awaitable[T]) -> T:
        """Await a count (in a thread or in worker processes), the background work waiting for it."""
        self.counting += 1
        try:
            return await counting
        finally:
            self.counting -= 1
            if not self.counting:
                waiting, self._waiting = self._waiting, []
                for start in waiting:
                    start()

    def after_counts(self, start: Callable[[], None]) -> None:
        """`start()` now if nothing is being counted, else once nothing is (or `MAX_WAIT_S` on)."""
        if not self.counting:
            start()
            return
        started = False

        def once() -> None:
            nonlocal started
            if not started:
                started = True
                if once in self._waiting:  # started by its timer: no longer waiting
                    self._waiting.remove(once)
                start()

        self._waiting.append(once)
        asyncio.get_running_loop().call_later(MAX_WAIT_S, once)


QUIET = Quiet()
"""One per process: every door's engine counts with it."""
