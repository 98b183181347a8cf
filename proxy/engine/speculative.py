"""Speculative Autocompact: compact in the background before the trigger is reached.

When a session crosses the lower watermark (`autocompact.speculative_ratio`, 70% of the
budget), the whole chain runs in a background task over the history as it is then, and
its result is kept as a pending record. When the trigger (85%) is reached, the pending
record is promoted if the client's history still starts with the messages it covers, so
that turn pays no LLM latency and the summary is made once; it is dropped only when that
span is gone (compaction.py), and a summary dropped is counted as waste (`summary_cost`). A
session that never reaches the trigger has paid for one summary it did not use.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass, replace
from typing import Any, Awaitable, Callable

from ctxgate.pipeline import planner
from ctxgate.pipeline.config import ExpandConfig
from ctxgate.pipeline.planner import CompactionPlan
from .content_store import ContentStore
from .turn_budget import Turn
from .session import Sessions
from .state import SessionState
from .summary_cost import SummaryCost, Waste, costed

log = logging.getLogger("ctxgate.speculative")


REMOTE_WAIT_S = 120.0
"""How long a turn at the trigger waits for a background compaction another replica runs
(its claim is renewed while that replica lives; a dead one's lapses within a lease)."""


@dataclass
class _Running:
    """One background compaction in flight in this process."""
    chain: "asyncio.Future[CompactionPlan | None]"
    """Its result once it ran; None when another replica holds the claim and runs it."""
    records_at_start: int
    expand: ExpandConfig
    """Where its originals are kept once it is (the turn's expansion settings)."""
    cost: SummaryCost
    """The summaries it paid for."""


class Speculator:
    def __init__(self, sessions: Sessions,
                 on_done: Callable[[SessionState], Awaitable[None]] | None = None,
                 content: ContentStore | None = None, on_waste: Waste | None = None) -> None:
        self._sessions = sessions
        self._on_waste = on_waste
        """Told of a finished background summary that is never kept (`summary_cost.Waste`)."""
        self._on_done = on_done
        """Called with the session locked once a speculation ended, kept or not (the WAL checkpoints it)."""
        self._content = content
        """Where the originals a kept speculation's notes name go, as a foreground compaction's do."""
        self._chains: dict[tuple[str, str], _Running] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, state: SessionState, turn: Turn, view: list[dict[str, Any]], target: int | None) -> None:
        """Start one background compaction for the session, unless one is ready, or in flight
        here or on another replica (`state.speculation`; `resume` decides whether to run it again)."""
        if state.speculation:
            return
        self._start(state, turn, view, target)

    def _start(self, state: SessionState, turn: Turn, view: list[dict[str, Any]], target: int | None) -> None:
        if state.speculative or state.speculation_wasted or state.key in self._chains:
            return
        snapshot = SessionState(state.tenant, state.session_id, collapse=state.collapse, breaker=state.breaker,
                                learned_max_input_tokens=state.learned_max_input_tokens)
        running = _Running(asyncio.get_running_loop().create_future(), len(state.records), turn.config.expand,
                           SummaryCost())
        self._chains[state.key] = running
        # In the WAL (a SPECULATION event): a restart while it is in flight starts it again.
        state.speculation = {"prefix_len": len(turn.messages), "prefix_hash": turn.prefix_hashes[-1],
                             "target": target, "records": len(state.records), "logged": False}
        task = asyncio.create_task(self._run(snapshot, turn, view, target, running))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def running(self, tenant: str, session_id: str) -> bool:
        """A background compaction of this session is in flight."""
        return (tenant, session_id) in self._chains

    def resume(self, state: SessionState, turn: Turn, view_of: Callable[[Turn], list[dict[str, Any]]]) -> None:
        """A turn finds a speculation in flight that this process does not run: after a restart,
        or started by another replica. It runs again over the same prefix, so the compaction it
        yields is the one a gateway that never crashed would apply, unless another replica
        still holds its claim (`SessionStore.speculating`): then that one's result is awaited."""
        pending = state.speculation
        if not pending or state.speculative or state.key in self._chains:
            return
        k = pending["prefix_len"]
        if (len(state.records) != pending["records"] or k > len(turn.fingerprints)
                or turn.prefix_hashes[k - 1] != pending["prefix_hash"]):
            state.speculation = {}  # the history moved on or was rewritten: nothing to redo
            return
        then = replace(turn, messages=turn.messages[:k], fingerprints=turn.fingerprints[:k])
        self._start(state, then, view_of(then), pending["target"])
        state.speculation["logged"] = True  # the same speculation, already in the log

    async def settle(self, state: SessionState) -> None:
        """Called with the session locked when the trigger is reached: a compaction still in
        flight, here or on another replica, is the one this turn needs, so wait for it rather
        than start another."""
        running = self._chains.get(state.key)
        if running is not None:
            try:
                run = await asyncio.shield(running.chain)
            except Exception:  # it failed: this turn compacts itself
                state.speculation = {}
                return
            if run is not None:  # it ran here
                if run.result.steps:
                    self._keep(state, _kept(run, running.cost), running.records_at_start)
                else:
                    state.speculation = {}  # nothing done
                return
        pending = state.speculation
        if not pending:
            return
        result = await self._sessions.store.speculation_result(state.tenant, state.session_id,
                                                               pending["prefix_hash"], REMOTE_WAIT_S)
        if result is not None and result["records"] == pending["records"]:
            self._keep(state, result["speculative"], result["records"])

    def _keep(self, state: SessionState, speculative: dict[str, Any], records_at_start: int) -> None:
        """The speculation ended: its result is kept as the pending record, unless the session
        compacted meanwhile (its summary then goes unused: counted) or it is kept already."""
        state.speculation = {}
        record = speculative["record"]
        if state.speculative.get("record") == record or any(
                r.prefix_hash == record["prefix_hash"] and r.created_at == record["created_at"] for r in state.records):
            return  # kept already (by the turn that waited for it, or the task that ran it), or applied since
        if len(state.records) != records_at_start or state.speculative:
            self._wasted(state, SummaryCost.from_dict(speculative.get("summary")), "superseded")
            return
        state.speculative = speculative
        log.info("session %s: compaction prepared in the background (%s, %d -> %d tokens)", state.session_id,
                 ",".join(record["levels"]), record["tokens_before"], record["tokens_after"])

    async def _run(self, snapshot: SessionState, turn: Turn, view: list[dict[str, Any]], target: int | None,
                   running: _Running) -> None:
        """The life of one background compaction: claimed across replicas, run, handed to
        whichever replica's turn needs it (its originals stored, its result published), then
        kept in the session."""
        tenant, session_id = snapshot.key
        try:
            async with self._sessions.store.speculating(tenant, session_id) as mine:
                # Another replica runs it, or ran it since this turn read the session (its result
                # is published): a turn takes that result.
                if not mine or await self._published(tenant, session_id, turn.prefix_hashes[-1],
                                                     running.records_at_start):
                    running.chain.set_result(None)
                    return
                # Started under the trigger: the request fits, and a point that would free
                # too little defers here as it would at the trigger.
                run = await planner.plan(costed(turn, running.cost), snapshot, view, target, "proactive", fits=True)
                if run.result.steps:
                    await self._hand_over(tenant, session_id, run, running, turn.prefix_hashes[-1])
                running.chain.set_result(run)
                async with self._sessions.transaction(tenant, session_id) as tx:
                    if run.result.steps:
                        self._keep(tx.state, _kept(run, running.cost), running.records_at_start)
                    else:
                        tx.state.speculation = {}
                        self._wasted(tx.state, running.cost, "unused")
                    # Kept or dropped, the speculation ended: the log says so, or a restart would
                    # find it still in flight there and ask for its summary again.
                    tx.write_log = self._on_done
        except Exception as e:  # a background task: log, never raise into nowhere
            log.warning("speculative compaction of session %s failed: %s", session_id, e)
            if not running.chain.done():
                # A turn at the trigger may be waiting for it in `settle`, the session locked:
                # told now, not after `_forget`, which needs that lock (they waited on each other).
                running.chain.set_exception(e)
                running.chain.exception()  # retrieved: no turn need be waiting
            await self._forget(tenant, session_id)
        finally:
            if not running.chain.done():
                running.chain.set_result(None)
            # Only now: until the result is saved, a turn at the trigger must find it here.
            self._chains.pop((tenant, session_id), None)

    async def _published(self, tenant: str, session_id: str, prefix_hash: str, records: int) -> bool:
        result = await self._sessions.store.speculation_result(tenant, session_id, prefix_hash, 0.0)
        return result is not None and result["records"] == records

    async def _hand_over(self, tenant: str, session_id: str, run: CompactionPlan, running: _Running,
                         prefix_hash: str) -> None:
        if self._content is not None and run.cuts:
            expand = running.expand
            await self._content.put(tenant, session_id, run.cuts, expand.store_max_bytes, expand.store_ttl_s)
        await self._sessions.store.publish_speculation(tenant, session_id, {
            "prefix_hash": prefix_hash, "records": running.records_at_start, "speculative": _kept(run, running.cost)})

    def _wasted(self, state: SessionState, cost: SummaryCost, why: str) -> None:
        if cost.calls:
            log.info("session %s: a background summary (%d tokens) is not kept (%s)", state.session_id, cost.tokens,
                     why)
            if self._on_waste is not None:
                self._on_waste(why, cost.calls, cost.tokens)

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


def _kept(run: CompactionPlan, cost: SummaryCost) -> dict[str, Any]:
    """What `SessionState.speculative` holds of a finished background compaction (with what its
    summary cost, counted as waste if it is dropped)."""
    return {"record": asdict(run.record), "collapse": run.collapse, "breaker": run.breaker, "working": run.working,
            "depth": run.depth.log_fields() if run.depth else {}, "summary": cost.to_dict()}
