"""Keys listed in a sorted-set index: removing every one whose value matches."""
from __future__ import annotations

from typing import Any, Callable

BATCH = 500
"""Values read per MGET."""


async def erase_matching(redis: Any, index: str, matches: Callable[[bytes], bool]) -> int:
    """Delete the keys `index` lists whose value `matches`, and their index entries; how many."""
    names = await redis.zrange(index, 0, -1)
    gone = []
    for at in range(0, len(names), BATCH):
        batch = names[at:at + BATCH]
        gone += [name for name, raw in zip(batch, await redis.mget(batch)) if raw is not None and matches(raw)]
    if gone:
        await redis.delete(*gone)
        await redis.zrem(index, *gone)
    return len(gone)
