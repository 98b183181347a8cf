"""The session transaction: the one way anything changes a session's state.

Lock the session (in-process or across replicas), load its state (from the store, or
rebuilt from its WAL when the store has not seen it since a restart), hand it out, write
what the change logs, and save it, once.

A domain failure inside (an upstream's error, a refusal, a cancelled request) still logs
and saves what was done before it: a compaction that ran, and was paid for, is kept, and
the WAL and the store never disagree about it. Any other exception is a bug: nothing of
the change is kept. It is neither logged nor saved, and the in-process copy the change
was made on is dropped, so the next request finds the state as the store or the WAL had
it before. The same holds when the WAL cannot take the change: it is not saved.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from ..errors import GatewayError
from ..upstream.errors import UpstreamError
from .journal import APPEND_FENCE, Journal
from .state import SessionState, SessionStore

log = logging.getLogger("ctxgate.wal")
WriteLog = Callable[[SessionState], Awaitable[None]]


@dataclass
class Transaction:
    state: SessionState
    write_log: WriteLog | None = None
    """What this change writes to the WAL, run before the save (set it once the change knows)."""


class Sessions:
    def __init__(self, store: SessionStore, journal: Journal) -> None:
        self.store = store
        self.journal = journal
        self._later: set[asyncio.Task[None]] = set()
        """Periodic checkpoints being written (`checkpoint_later`)."""

    @asynccontextmanager
    async def transaction(self, tenant: str, session_id: str) -> AsyncIterator[Transaction]:
        async with self.store.lock(tenant, session_id):
            tx = Transaction(await self._load(tenant, session_id))
            try:
                yield tx
            except (GatewayError, UpstreamError):
                await self._commit(tx)
                raise
            except Exception:
                await self.store.forget(tenant, session_id)
                raise
            except BaseException:  # cancelled: what ran before is kept, as for a domain failure
                await self._commit(tx)
                raise
            await self._commit(tx)

    async def _commit(self, tx: Transaction) -> None:
        """The WAL first, then the store: a change the WAL could not take is not saved either.
        Neither is written by a replica whose hold on the session lapsed: the session lock is
        checked by the state's save script, by the log's append script when the log is in the
        same Redis, and by a read before the append when it is not (`SessionStore.confirm`)."""
        fence = self.store.fence(tx.state)
        if tx.write_log is not None:
            if fence is not None and not self.journal.checks(fence):
                await self.store.confirm(tx.state)
            fenced = APPEND_FENCE.set(fence)
            try:
                await tx.write_log(tx.state)
            except BaseException:
                await self.store.forget(tx.state.tenant, tx.state.session_id)
                raise
            finally:
                APPEND_FENCE.reset(fenced)
        await self.store.save(tx.state)

    def checkpoint_later(self, tenant: str, session_id: str) -> None:
        """The periodic CHECKPOINT a session owes (`Journal.due`), written once the turn that
        made it due has handed its reply on (the next turn of the loop): the session's next
        turn waits for it (the session lock), no reply does. A crash before it only leaves
        recovery more events to read after the last checkpoint."""
        asyncio.get_running_loop().call_soon(self._start_checkpoint, tenant, session_id)

    def _start_checkpoint(self, tenant: str, session_id: str) -> None:
        task = asyncio.ensure_future(self._checkpoint(tenant, session_id))
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def _checkpoint(self, tenant: str, session_id: str) -> None:
        try:
            async with self.store.lock(tenant, session_id):
                state = await self.store.load(tenant, session_id)
                if state is None or self.journal.stale(state) or not self.journal.due(state):
                    return  # erased, changed from the CLI, or checkpointed by a turn since
                await self._commit(Transaction(state, lambda s: self.journal.checkpoint(s, "periodic")))
        except Exception as e:  # the turn is logged and answered: the next turn owes it again
            log.warning("session %s/%s: periodic checkpoint not written: %s", tenant, session_id, e)

    async def read(self, tenant: str, session_id: str) -> SessionState | None:
        """The session as it is now, without changing it; None when it never existed."""
        async with self.store.lock(tenant, session_id):
            return await self.store.load(tenant, session_id) or await self.journal.recover(tenant, session_id)

    async def recover(self, tenant: str, session_id: str) -> bool:
        """Rebuild a session from its WAL into the store, unless the store has it already."""
        async with self.store.lock(tenant, session_id):
            if await self.store.load(tenant, session_id) is not None:
                return False
            state = await self.journal.recover(tenant, session_id)
            if state is None:
                return False
            await self.store.save(state)
            return True

    async def _load(self, tenant: str, session_id: str) -> SessionState:
        state = await self.store.load(tenant, session_id)
        if state is not None and not self.journal.stale(state):
            return state
        recovered = await self.journal.recover(tenant, session_id)
        return recovered or state or SessionState(tenant, session_id)

    async def ping(self) -> bool:
        return await self.store.ping()

    async def close(self) -> None:
        if self._later:  # owed checkpoints are written before the state goes
            await asyncio.gather(*self._later, return_exceptions=True)
        await self.store.close()
