"""The one interface every level implements, and the bookkeeping they share."""
from __future__ import annotations

import time
from typing import Protocol

from .request import CompressionRequest
from .types import CompactionStep, CompressionResult, Level, Message


class Strategy(Protocol):
    """A compression level: returns None when it has nothing to do on this input."""

    level: Level

    async def compress(self, request: CompressionRequest) -> CompressionResult | None: ...


class Stopwatch:
    def __init__(self) -> None:
        self._started = time.perf_counter()

    @property
    def ms(self) -> float:
        return (time.perf_counter() - self._started) * 1000


def level_result(level: Level, request: CompressionRequest, messages: list[Message], span: tuple[int, int],
                 watch: Stopwatch, affected: int, hints: list[str] | None = None) -> CompressionResult:
    """A level's result, with its one step recorded and `fits` judged against the budget."""
    counter = request.counter
    before = counter.count_messages(request.messages)
    after = counter.count_messages(messages)
    step = CompactionStep(level=level, span=span, tokens_before=before, tokens_after=after,
                          duration_ms=watch.ms, messages_affected=affected)
    return CompressionResult(compressed_messages=messages, tokens_freed=max(0, before - after), level_used=level,
                             recovery_hints=list(hints or []), steps=[step], tokens_after=after,
                             fits=after <= request.token_budget)
