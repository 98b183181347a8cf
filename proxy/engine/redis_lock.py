"""A Redis lock held as a lease, shared by every replica.

It is taken with a short expiry and renewed every third of it while held: a holder that
dies (`kill -9`, a lost machine) frees it within one lease, and a live holder keeps it
however long its work takes (an Autocompact call, a long stream).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from ..errors import ErrorKind, GatewayError
from .state import reachable

log = logging.getLogger("ctxgate.state")

LEASE_S = 10.0


def lease_lost(tenant: str, session_id: str) -> GatewayError:
    """What a commit meets when this replica's lease on the session lapsed (cut off from Redis
    past the lease) and another may have carried the session on: nothing of the turn is kept."""
    log.warning("session %s/%s: its lock lapsed while this replica held it (cut off from Redis past the lease): "
                "this turn is neither logged nor saved", tenant, session_id)
    return GatewayError(ErrorKind.UNAVAILABLE, f"session {session_id} was taken over by another replica while this "
                        "one was cut off from Redis; retry", code="session_lease_lost")


@asynccontextmanager
async def leased(redis: Any, name: str, wait_s: float | None, busy: Callable[[], GatewayError],
                 lease_s: float = LEASE_S) -> AsyncIterator[Any]:
    """Hold the lock `name`, waiting for it at most `wait_s` (None: while its holder lives),
    else raise `busy()`. Yields redis-py's lock: its `name` and `local.token` fence a write."""
    lock = redis.lock(name, timeout=lease_s, blocking_timeout=wait_s)
    with reachable():
        acquired = await lock.acquire()
    if not acquired:
        raise busy()
    async with _held(lock, name, lease_s):
        yield lock


@asynccontextmanager
async def leased_if_free(redis: Any, name: str, lease_s: float = LEASE_S) -> AsyncIterator[bool]:
    """Hold the lock `name` if nobody does (yields True), else yield False at once."""
    lock = redis.lock(name, timeout=lease_s)
    with reachable():
        acquired = await lock.acquire(blocking=False)
    if not acquired:
        yield False
        return
    async with _held(lock, name, lease_s):
        yield True


@asynccontextmanager
async def _held(lock: Any, name: str, lease_s: float) -> AsyncIterator[None]:
    """Renew `lock` while the body runs; release it after."""
    renewing = asyncio.create_task(_renew(lock, name, lease_s))
    try:
        yield
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
        try:
            await lock.release()
        except Exception:  # lapsed while Redis was away: the next holder already owns it
            pass


async def _renew(lock: Any, name: str, lease_s: float) -> None:
    from redis.exceptions import LockError, RedisError

    while True:
        await asyncio.sleep(lease_s / 3)
        try:
            await lock.extend(lease_s, replace_ttl=True)
        except LockError:  # it lapsed (Redis away longer than the lease): another may hold it now
            log.warning("lock %s lapsed while held", name)
            return
        except RedisError:  # Redis briefly away: try again while the lease still runs
            continue
