"""A large conversation's count and compaction off the event loop.

The planner (`pipeline/planner.py`) is plain Python over message lists, with one await: the
Autocompact summary, `turn.summarize`. For a conversation of tens of thousands of tokens or
more, it runs in a thread with an event loop of its own (the event loop serving requests
gets the GIL back every switch interval meanwhile), and a summary it asks for is sent from
the serving loop, whose HTTP client and stores it needs. A small conversation is planned
inline: a thread and a loop cost more than its planning.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, Callable, Coroutine, TypeVar

from ctxgate.pipeline.budget import Turn
from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.tokens import TokenCounter
from .quiet import QUIET

T = TypeVar("T")

HEAVY_MESSAGE_TOKENS = 32_768
"""A conversation counted at least this large is read and planned in a thread."""
HEAVY_MESSAGES = 1_000
"""The same for one not counted yet: this many messages."""
INLINE_INDEX_BYTES = 1 << 20
"""A request's new messages are fingerprinted inline below this many bytes and HEAVY_MESSAGES
messages: ~0.4 ms for a new 107K-token conversation (337 messages, 426 KB), where a thread
hop on a busy machine waits 1-5 ms for the thread to be scheduled and as long for the loop."""


def index_inline(new_messages: int, body_bytes: int) -> bool:
    """Fingerprinting this many new messages of a body this large costs less than a thread hop."""
    return new_messages < HEAVY_MESSAGES and body_bytes < INLINE_INDEX_BYTES


def heavy(turn: Turn) -> bool:
    index = turn.index
    if index is not None and index.is_counted and len(index) == len(turn.messages):
        return index.tokens() >= HEAVY_MESSAGE_TOKENS
    return len(turn.messages) >= HEAVY_MESSAGES


async def count_off_loop(index: HistoryIndex, messages: list[dict[str, Any]], counter: TokenCounter,
                         body_bytes: int) -> HistoryIndex:
    """`index.counted(messages, counter)`: on the event loop for a body of at most the
    tokenizer's `inline_count_bytes`, else in a thread, a count in flight for `QUIET`. One thread
    is enough: gigatoken gives the GIL up while it encodes and counts a new 107K conversation in
    ~3 ms (worker processes took longer, their pipes and parsing included: 4.3 ms at 107K,
    13 ms against 6.8 at 400K)."""
    if body_bytes <= counter.inline_count_bytes:
        return index.counted(messages, counter)
    return await QUIET.around(asyncio.to_thread(index.counted, messages, counter))


async def run_sync(turn: Turn, work: Callable[[], T]) -> T:
    """`work()`: in a thread for a heavy turn, else inline."""
    return await asyncio.to_thread(work) if heavy(turn) else work()


async def run_planner(turn: Turn, plan: Callable[[Turn], Coroutine[Any, Any, T]]) -> T:
    """`plan(turn)`: for a heavy turn, on a loop of its own in a thread, its summaries asked
    for on this loop."""
    if not heavy(turn):
        return await plan(turn)
    serving = asyncio.get_running_loop()
    ask = turn.summarize

    async def asked(prompt: list[dict[str, Any]]) -> str:
        return await ask(prompt)

    async def summarize(prompt: list[dict[str, Any]]) -> str:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asked(prompt), serving))

    bridged = replace(turn, summarize=summarize)
    return await asyncio.to_thread(lambda: asyncio.run(plan(bridged)))
