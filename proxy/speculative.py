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
from dataclasses import asdict
from typing import Any

from .compaction import Turn, run_chain
from .state import SessionState, SessionStore

log = logging.getLogger("ctxgate.speculative")


class Speculator:
    def __init__(self, sessions: SessionStore) -> None:
        self._sessions = sessions
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.started = 0
        self.prepared = 0

    def start(self, state: SessionState, turn: Turn, view: list[dict[str, Any]], target: int) -> None:
        """Start one background compaction for the session, unless one is running or ready."""
        if state.speculative or state.key in self._running:
            return
        snapshot = SessionState(state.tenant, state.session_id, collapse=state.collapse, breaker=state.breaker,
                                learned_max_input_tokens=state.learned_max_input_tokens)
        records_at_start = len(state.records)
        task = asyncio.create_task(self._run(snapshot, turn, view, target, records_at_start))
        self._running[state.key] = task
        task.add_done_callback(lambda _: self._running.pop(state.key, None))
        self.started += 1

    async def _run(self, snapshot: SessionState, turn: Turn, view: list[dict[str, Any]], target: int,
                   records_at_start: int) -> None:
        try:
            run = await run_chain(snapshot, turn, view, target, "proactive")
        except Exception as e:  # a background task: log, never raise into nowhere
            log.warning("speculative compaction of session %s failed: %s", snapshot.session_id, e)
            return
        if not run.result.steps:
            return
        async with self._sessions.lock(snapshot.tenant, snapshot.session_id):
            state = await self._sessions.load(snapshot.tenant, snapshot.session_id)
            if state is None or len(state.records) != records_at_start or state.speculative:
                return  # the session compacted meanwhile: this result is stale
            state.speculative = {"record": asdict(run.record), "collapse": run.collapse, "breaker": run.breaker,
                                 "working": run.working}
            await self._sessions.save(state)
        self.prepared += 1
        log.info("session %s: compaction prepared in the background (%s, %d -> %d tokens, %.0f ms)",
                 snapshot.session_id, ",".join(run.record.levels), run.record.tokens_before,
                 run.record.tokens_after, run.duration_ms)

    async def close(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
