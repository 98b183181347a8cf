"""Speculative Autocompact: compact in the background before the trigger is reached.

When a session crosses the lower watermark (`autocompact.speculative_ratio`, 70% of the
budget), the whole chain runs in a background task over the history as it is then, and
its result is kept as a pending record. When the trigger (85%) is reached, the pending
record is promoted if the client's history still starts with the messages it covers, so
that turn pays no LLM latency and the summary is made once. A session that never reaches
the trigger has paid for one summary it did not use.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass, replace
from typing import Any, Awaitable, Callable

from ...pipeline.config import ExpandConfig
from .compaction import ChainRun, run_chain
from .content_store import ContentStore
from .turn_budget import Turn
from .session import Sessions
from .state import SessionState

log = logging.getLogger("ctxgate.speculative")


@dataclass
class _Running:
    """One background compaction in flight."""
    chain: "asyncio.Task[ChainRun]"
    records_at_start: int
    expand: ExpandConfig
    """Where its originals are kept once it is (the turn's expansion settings)."""


class Speculator:
    def __init__(self, sessions: Sessions,
                 on_done: Callable[[SessionState], Awaitable[None]] | None = None,
                 content: ContentStore | None = None) -> None:
        self._sessions = sessions
        self._on_done = on_done
        """Called with the session locked once a speculation ended, kept or not (the WAL checkpoints it)."""
        self._content = content
        """Where the originals a kept speculation's notes name go, as a foreground compaction's do."""
        self._chains: dict[tuple[str, str], _Running] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, state: SessionState, turn: Turn, view: list[dict[str, Any]], target: int | None) -> None:
        """Start one background compaction for the session, unless one is running or ready."""
        if state.speculative or state.speculation_wasted or state.key in self._chains:
            return
        snapshot = SessionState(state.tenant, state.session_id, collapse=state.collapse, breaker=state.breaker,
                                learned_max_input_tokens=state.learned_max_input_tokens)
        chain = asyncio.create_task(run_chain(snapshot, turn, view, target, "proactive"))
        self._chains[state.key] = _Running(chain, len(state.records), turn.config.expand)
        # In the WAL (a SPECULATION event): a restart while it is in flight starts it again.
        state.speculation = {"prefix_len": len(turn.messages), "prefix_hash": turn.prefix_hashes[-1],
                             "target": target, "records": len(state.records), "logged": False}
        task = asyncio.create_task(self._persist(snapshot.tenant, snapshot.session_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def running(self, tenant: str, session_id: str) -> bool:
        """A background compaction of this session is in flight."""
        return (tenant, session_id) in self._chains

    def resume(self, state: SessionState, turn: Turn, view_of: Callable[[Turn], list[dict[str, Any]]]) -> None:
        """First turn after a restart: the speculation the log says was in flight runs again
        over the same prefix, so the compaction it yields is the one a gateway that never
        crashed would apply."""
        pending = state.speculation
        if not pending or state.speculative or state.key in self._chains:
            return
        k = pending["prefix_len"]
        if (len(state.records) != pending["records"] or k > len(turn.fingerprints)
                or turn.prefix_hashes[k - 1] != pending["prefix_hash"]):
            state.speculation = {}  # the history moved on or was rewritten: nothing to redo
            return
        then = replace(turn, messages=turn.messages[:k], fingerprints=turn.fingerprints[:k])
        self.start(state, then, view_of(then), pending["target"])
        state.speculation["logged"] = True  # the same speculation, already in the log

    async def settle(self, state: SessionState) -> None:
        """Called with the session locked when the trigger is reached: a compaction still in
        flight is the one this turn needs, so wait for it rather than start another."""
        running = self._chains.get(state.key)
        if running is None:
            return
        try:
            run = await asyncio.shield(running.chain)
        except Exception:
            return
        await self._keep(state, run, running)

    async def _keep(self, state: SessionState, run: ChainRun, running: _Running) -> None:
        """The speculation ended: its result is kept as the pending record, unless stale."""
        state.speculation = {}
        if not run.result.steps or len(state.records) != running.records_at_start or state.speculative:
            return  # nothing done, or the session compacted meanwhile: stale
        if self._content is not None and run.cuts:
            expand = running.expand
            await self._content.put(state.tenant, state.session_id, run.cuts, expand.store_max_bytes,
                                    expand.store_ttl_s)
        state.speculative = {"record": asdict(run.record), "collapse": run.collapse, "breaker": run.breaker,
                             "working": run.working, "depth": run.depth.log_fields() if run.depth else {}}
        log.info("session %s: compaction prepared in the background (%s, %d -> %d tokens, %.0f ms)",
                 state.session_id, ",".join(run.record.levels), run.record.tokens_before,
                 run.record.tokens_after, run.duration_ms)

    async def _persist(self, tenant: str, session_id: str) -> None:
        running = self._chains[(tenant, session_id)]
        try:
            run = await running.chain
            async with self._sessions.transaction(tenant, session_id) as tx:
                await self._keep(tx.state, run, running)
                # Kept or dropped, the speculation ended: the log says so, or a restart would find
                # it still in flight there and ask for its summary again.
                tx.write_log = self._on_done
        except Exception as e:  # a background task: log, never raise into nowhere
            log.warning("speculative compaction of session %s failed: %s", session_id, e)
            await self._forget(tenant, session_id)
        finally:
            # Only now: until the result is saved, a turn at the trigger must find it here.
            self._chains.pop((tenant, session_id), None)

    async def _forget(self, tenant: str, session_id: str) -> None:
        try:
            async with self._sessions.transaction(tenant, session_id) as tx:
                tx.state.speculation = {}
                tx.write_log = self._on_done
        except Exception as e:
            log.warning("session %s: a failed speculation could not be cleared: %s", session_id, e)

    async def close(self) -> None:
        pending = [running.chain for running in self._chains.values()] + list(self._tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
