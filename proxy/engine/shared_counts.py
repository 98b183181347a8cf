"""Token counts of a session's history, shared between replicas through Redis.

A replica keeps each session's last request in its own `HistoryCache`, so a steady turn
counts only its new messages. A turn that lands on a replica that never saw the session
(after a restart, a failover, a load balancer without stickiness) would count the whole
history again: tokenizing is the expensive part of a turn (hashing is ~50x cheaper). Each
counted turn therefore leaves its messages' counts in Redis, and such a replica reads them,
checks them against the prefix hashes of the request it holds, and counts only what is new.

    ctxgate:session:{tag}<t>:<s>:counts:<tokenizer>   list: "<prefix hash> <count>" per message

An entry names the prefix ending at its message, so one comparison (the last entry that can
apply against the request's own hash at that position) proves every count before it. A
write sends only the entries past what this process last knew the list to hold, after
checking that the list still agrees there; otherwise it rewrites the list (a rewritten
history, another replica's longer or diverging turn).
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.redis_backend import RedisTarget

log = logging.getLogger("ctxgate.history")
_TTL_S = 7 * 24 * 3600
_KNOWN_SESSIONS = 4096
"""Sessions whose stored length this process remembers (to send only what is new)."""

_EXTEND = """
local start = tonumber(ARGV[2])
if start > 0 then
  local at = redis.call('LINDEX', KEYS[1], start - 1)
  if not at or string.sub(at, 1, #ARGV[3]) ~= ARGV[3] then return -1 end
end
if start == 0 then redis.call('DEL', KEYS[1]) else redis.call('LTRIM', KEYS[1], 0, start - 1) end
for i = 4, #ARGV do redis.call('RPUSH', KEYS[1], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return redis.call('LLEN', KEYS[1])
"""
"""KEYS: the list. ARGV: the TTL, where the new entries start, the prefix hash the entry
before them must name (empty from 0), the entries. -1 (nothing written): the list does not
agree there."""


class SharedCounts:
    def __init__(self, url: str, ttl_s: int = _TTL_S) -> None:
        self._target = RedisTarget.parse(url)
        self._redis = self._target.async_client()
        self._ttl = ttl_s
        self._extend = self._redis.register_script(_EXTEND)
        self._stored: OrderedDict[tuple[str, str], int] = OrderedDict()
        """How many entries this process last knew a session's list to hold."""
        self._writing: set[asyncio.Task[Any]] = set()

    def _key(self, tenant: str, session_id: str, counter_name: str) -> str:
        return f"ctxgate:session:{self._target.tag(tenant, session_id)}{tenant}:{session_id}:counts:{counter_name}"

    async def known(self, tenant: str, session_id: str, index: HistoryIndex) -> list[int]:
        """The stored counts of `index`'s leading messages, in one round trip: the entries up to
        the request's length, kept when the last of them names the request's own prefix there."""
        if not len(index):
            return []
        entries = await self._redis.lrange(self._key(tenant, session_id, index.counter_name), 0, len(index) - 1)
        if not entries or entries[-1].split(b" ", 1)[0].decode() != index.prefix_hashes[len(entries) - 1]:
            return []
        self._note(tenant, session_id, len(entries))
        return [int(e.split(b" ", 1)[1]) for e in entries]

    def keep_later(self, tenant: str, session_id: str, index: HistoryIndex) -> None:
        """`keep` in the background: a reply never waits for it, and a write that fails costs
        only a recount on some other replica."""
        task = asyncio.ensure_future(self.keep(tenant, session_id, index))
        self._writing.add(task)
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[Any]) -> None:
        self._writing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("token counts not shared: %s", task.exception())

    async def keep(self, tenant: str, session_id: str, index: HistoryIndex) -> None:
        """Store `index`'s counts: from where this process last knew the list to end, or all
        of them when the list disagrees there."""
        if not index.is_counted or not len(index):
            return
        key = self._key(tenant, session_id, index.counter_name)
        start = min(self._stored.get((tenant, session_id), 0), len(index))
        written = await self._write(key, index, start)
        if written < 0 and start:
            written = await self._write(key, index, 0)
        self._note(tenant, session_id, max(written, 0))

    async def _write(self, key: str, index: HistoryIndex, start: int) -> int:
        totals = index.cumulative_tokens
        entries = [f"{index.prefix_hashes[i]} {totals[i + 1] - totals[i]}" for i in range(start, len(index))]
        before = index.prefix_hashes[start - 1] if start else ""
        return int(await self._extend(keys=[key], args=[self._ttl, start, before, *entries]))

    def _note(self, tenant: str, session_id: str, stored: int) -> None:
        self._stored[(tenant, session_id)] = stored
        self._stored.move_to_end((tenant, session_id))
        while len(self._stored) > _KNOWN_SESSIONS:
            self._stored.popitem(last=False)

    async def close(self) -> None:
        if self._writing:
            await asyncio.wait(list(self._writing), timeout=5)
        await self._redis.aclose()


def open_shared_counts(state_url: str) -> SharedCounts | None:
    """Shared where the state is shared (Redis); one process alone has nothing to share."""
    return None if state_url == "memory" else SharedCounts(state_url)
