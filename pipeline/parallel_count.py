"""A large history counted on all cores.

tiktoken (and a Hugging Face tokenizer) release the GIL while they encode, so the messages of
a new conversation of a hundred thousand tokens, cut into one contiguous slice per core and
counted in threads, take about the time of one slice. The counts are the same as
`HistoryIndex.counted`'s, message by message: only who counts them changes. A small history is
counted in the calling thread, where a hop would cost more than the work.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .history_index import HistoryIndex
from .tokens import TokenCounter

PARALLEL_CHARS = 64_000
"""A history with fewer characters to count than this is counted in one thread (~3 ms)."""
CORES = max(1, min(8, os.cpu_count() or 1))
_POOL = ThreadPoolExecutor(max_workers=CORES, thread_name_prefix="ctxgate-count")
"""Its own threads: a count waits on them from a thread of asyncio's default executor, which a
pool it shared could fill."""


def _size(message: dict[str, Any]) -> int:
    """About how much of `message` there is to tokenize, for cutting even slices (not a count)."""
    content = message.get("content")
    n = len(content) if isinstance(content, str) else 200 * len(content) if isinstance(content, list) else 0
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        arguments = fn.get("arguments") if isinstance(fn, dict) else None
        n += len(arguments) if isinstance(arguments, str) else 0
    return n + 16


def slices(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous (start, end) ranges over `sizes`, each holding about an even share
    of their sum; none empty."""
    total = sum(sizes)
    out: list[tuple[int, int]] = []
    start = acc = 0
    for i, n in enumerate(sizes):
        acc += n
        if len(out) < parts - 1 and acc * parts >= total * (len(out) + 1) and i + 1 < len(sizes):
            out.append((start, i + 1))
            start = i + 1
    out.append((start, len(sizes)))
    return [(a, b) for a, b in out if b > a]


def counted_on_all_cores(index: HistoryIndex, messages: list[dict[str, Any]], counter: TokenCounter) -> HistoryIndex:
    """`index.counted(messages, counter)`, its uncounted messages counted in one slice per core."""
    first = len(index.cumulative_tokens) - 1
    sizes = [_size(m) for m in messages[first:]]
    if CORES == 1 or sum(sizes) < PARALLEL_CHARS:
        return index.counted(messages, counter)
    fps = index.fingerprints

    def count(bounds: tuple[int, int]) -> list[int]:
        return [counter.count_structured(messages[i], fps[i]) for i in range(first + bounds[0], first + bounds[1])]

    ranges = slices(sizes, CORES)
    others = [_POOL.submit(count, r) for r in ranges[1:]]
    counts = count(ranges[0])  # this thread counts a slice too
    for f in others:
        counts += f.result()
    return index.with_counts(counts)
