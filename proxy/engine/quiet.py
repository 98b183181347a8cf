"""Counts first, background work after.

A turn's count runs in a thread that gives the GIL up while it encodes and takes it back
after every text: a thread that holds the GIL meanwhile (memory's capture, regular expressions
over every new message) makes each of those returns wait a switch interval. A 107K-token count
took 59 ms beside a capture instead of 38 alone (with tiktoken, ten times slower than
gigatoken). So work done for later turns waits while this process counts, up to
`MAX_WAIT_S`. Work already running when a count starts waits too, between its steps
(`pauser`): a new 107K conversation's capture (~20 ms of CPU in a thread) otherwise ran
through the next conversation's count and its WAL lines, and held that reply back ~17 ms.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

MAX_WAIT_S = 2.0
"""The longest background work waits for counts that keep coming."""


class Quiet:
    """The counts in flight in this process, and the work waiting for none to be."""

    def __init__(self) -> None:
        self.counting = 0
        self._waiting: list[Callable[[], None]] = []
        self._idle = threading.Event()
        """Set while nothing is counted: what a paused thread waits for."""
        self._idle.set()

    async def around(self, counting: Awaitable[T]) -> T:
        """Await a count, the background work waiting for it."""
        self.counting += 1
        self._idle.clear()
        try:
            return await counting
        finally:
            self.counting -= 1
            if not self.counting:
                self._idle.set()
                waiting, self._waiting = self._waiting, []
                for start in waiting:
                    start()

    def pauser(self) -> Callable[[], None]:
        """For one piece of background work in a thread: called between its steps, gives the
        GIL back and, while this process counts, waits for it to stop; at most `MAX_WAIT_S` of
        waiting in all over the work's life (however long it queued before it ran), so counts
        that keep coming delay it but never starve it."""
        left = MAX_WAIT_S

        def pause() -> None:
            nonlocal left
            if left > 0 and not self._idle.is_set():
                began = time.monotonic()
                self._idle.wait(left)
                left -= time.monotonic() - began
            time.sleep(0)
        return pause

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
