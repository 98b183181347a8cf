"""The last hour, a minute at a time: what the dashboard charts without a Prometheus server.

A fixed ring of 60 buckets, one per wall-clock minute, written where the metrics counters
are incremented. It is per process: with several workers each has its own ring.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

MINUTES = 60


@dataclass
class Minute:
    start: int
    """The minute's first second (Unix time, a multiple of 60)."""
    requests: int = 0
    errors: int = 0
    tokens_in: int = 0
    """What the clients sent, counted by ctxgate."""
    tokens_out: int = 0
    """What was forwarded after compaction."""
    compactions: int = 0


class MinuteRing:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._buckets: list[Minute | None] = [None] * MINUTES

    def _now(self) -> Minute:
        start = int(self._clock()) // 60 * 60
        slot = start // 60 % MINUTES
        bucket = self._buckets[slot]
        if bucket is None or bucket.start != start:  # a minute an hour old is reused
            bucket = self._buckets[slot] = Minute(start)
        return bucket

    def request(self, failed: bool) -> None:
        bucket = self._now()
        bucket.requests += 1
        bucket.errors += failed

    def tokens(self, tokens_in: int, tokens_out: int) -> None:
        bucket = self._now()
        bucket.tokens_in += tokens_in
        bucket.tokens_out += tokens_out

    def compaction(self) -> None:
        self._now().compactions += 1

    def last_hour(self) -> list[dict[str, int]]:
        """Every minute of the last hour, oldest first, the quiet ones as zeros."""
        now = int(self._clock()) // 60 * 60
        kept = {b.start: b for b in self._buckets if b is not None}
        return [asdict(kept.get(start) or Minute(start)) for start in range(now - 60 * (MINUTES - 1), now + 60, 60)]
