"""The compactor: the I/O shell of a compaction point. Each turn it loads what the session's
records make of the request (`ctxgate.pipeline.views`), asks the planner what the turn needs
and plans the point (`ctxgate.pipeline.planner`), then applies the plan to the session: the
record, the stores, the loop guard, the originals kept for expansion, the compaction log
the journal writes. The loop guard (`has_attempted_reactive_compact`) is described in
docs/compaction.md (the loop guard and CONTEXT_EXHAUSTED).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from ctxgate.pipeline import planner
from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.notes import with_notice
from ctxgate.pipeline.planner import Action, Decision
from ctxgate.pipeline.protocols import PLAIN, detect_dialect
from ctxgate.pipeline.turns import task_index
from ctxgate.pipeline.types import Reason
from ctxgate.pipeline.views import compaction_view, forwarded_view
from ..errors import context_exhausted
from .content_store import ContentStore, MemoryContentStore
from .off_loop import HEAVY_MESSAGES, run_planner, run_sync
from .state import CompactionRecord, SessionState
from .summary_cost import SummaryCost, Waste, costed, summary_kept
from .turn_budget import Plan, Turn, budget_of, limit_of

if TYPE_CHECKING:
    from .speculative import Speculator

log = logging.getLogger("ctxgate.compaction")


def _read_dialect(state: SessionState, turn: Turn) -> None:
    """The session's dialect on `turn`: detected the first time a turn may compact and the
    conversation shows one, then remembered, so its reading never changes between turns."""
    if not state.dialect:
        found = detect_dialect(turn.messages, task_index(turn.messages))
        state.dialect = "" if found == PLAIN else found
    turn.dialect = state.dialect or PLAIN


def _set_guard(state: SessionState, turn: Turn) -> None:
    """The loop guard: set by any compaction, reset by a successful reply, and owned by the
    request that set it. The same request again (a client retrying what was refused) meets
    it set: no compaction, CONTEXT_EXHAUSTED at once, never a loop. A request with other
    messages is a new turn of the agent, not a retry: it is compacted afresh, rather than
    one refusal ending the session for good."""
    state.has_attempted_reactive_compact = True
    state.guard_request = turn.prefix_hashes[-1]


class Compactor:
    def __init__(self, on_step: Callable[[dict[str, Any]], None] | None = None,
                 speculator: "Speculator | None" = None, content: ContentStore | None = None,
                 on_merge: Callable[[], None] | None = None, on_waste: Waste | None = None) -> None:
        self._on_step = on_step
        self._on_merge = on_merge
        """Called when a compaction point merged the earlier notes (a metric counts it)."""
        self._on_waste = on_waste
        """Told of summaries paid for that end in no note sent (`summary_cost.Waste`)."""
        self.speculator = speculator
        self.content: ContentStore = content or MemoryContentStore()
        """Where the originals a compaction cut are kept for expansion."""

    async def prepare(self, state: SessionState, turn: Turn, fit: bool = True) -> Plan:
        """What the turn forwards. `fit`: refused (or degraded) when over the budget (`fitted`);
        False: planned whatever its size (a preview's count)."""
        if state.has_attempted_reactive_compact and state.guard_request != turn.prefix_hashes[-1]:
            state.has_attempted_reactive_compact = False  # a new turn, not a retry of the refused one
        plan = await self._planned(state, turn)
        return await self.fitted(state, turn, plan) if fit else plan

    async def _planned(self, state: SessionState, turn: Turn) -> Plan:
        # The view and a turn far from the trigger cost per message, not per token (the index
        # has the counts): a thread hop costs more than they do below a thousand messages.
        few = len(turn.messages) < HEAVY_MESSAGES
        view, tokens = forwarded_view(state, turn) if few else \
            await run_sync(turn, lambda: forwarded_view(state, turn))
        reads = bool(state.speculation) or planner.may_compact(turn, state, tokens)
        if reads:
            # Only a turn that may compact reads the conversation.
            await run_sync(turn, lambda: _read_dialect(state, turn))
        if state.speculation and self.speculator is not None:
            self.speculator.resume(state, turn, lambda then: compaction_view(state, then))
        guard, speculating = state.has_attempted_reactive_compact, self.speculator is not None
        decision = planner.decide(turn, state, tokens, guard, speculating) if few and not reads else \
            await run_sync(turn, lambda: planner.decide(turn, state, tokens, guard, speculating))
        if decision.action is Action.FORWARD:
            if decision.speculate and self.speculator is not None:
                self.speculator.start(state, turn, compaction_view(state, turn), decision.target)
            return Plan(messages=view, tokens_out=tokens - turn.count_offset)
        if decision.action is not Action.COMPACT:
            return await self._exhausted(state, turn, view, decision)
        if self.speculator is not None:
            await self.speculator.settle(state)
        taken = self._take_speculative(state, turn)
        if taken is not None and taken.view is not None:
            record = state.records[-1]
            return Plan(messages=taken.view, tokens_out=taken.tokens - turn.count_offset,
                        levels=list(dict.fromkeys(record.levels)),
                        hints=["speculative: applied the compaction prepared in the background"])
        if taken is not None:
            # Its summary is kept, but it leaves too little room: what came since is compacted
            # on top of it now, rather than its summary paid for nothing and the span summarised
            # again. Speculating does not pay in a session that grows this fast: it stops.
            state.speculation_wasted += 1
            view = forwarded_view(state, turn)[0]
        return await self._compact(state, turn, compaction_view(state, turn), decision.target, "proactive", as_is=view)

    async def client_asked(self, state: SessionState, turn: Turn, target: int) -> Plan:
        """A compaction the client asked for through a provider's API (engine/client_compaction.py), to `target`."""
        return await self._compact(state, turn, turn.messages, target, "client")

    async def _exhausted(self, state: SessionState, turn: Turn, view: list[dict[str, Any]],
                         decision: Decision) -> Plan:
        """CONTEXT_EXHAUSTED, or the degraded mode's one forced Autocompact."""
        if decision.action is Action.EXHAUSTED:
            raise context_exhausted(decision.why)
        plan = await self._compact(state, planner.degraded(turn), view, decision.target, "degrade")
        plan.degraded = True
        return plan

    def _take_speculative(self, state: SessionState, turn: Turn) -> planner.Adoption | None:
        """The background compaction applied to the session as a record, if the client's history
        still has the span it covers (`planner.adoption`: with its view when it also leaves the
        room a speculation aims for); dropped, its summary counted as waste, only when that span
        is gone. None: there was none, or it was dropped."""
        pending = state.speculative.get("record")
        if not pending:
            return None
        record = CompactionRecord.from_dict(pending)
        adopted = planner.adoption(turn, state, record)
        if adopted.view is None and not adopted.wasted:
            self._drop_speculative(state, "stale")
            return None
        state.collapse, state.breaker = state.speculative["collapse"], state.speculative["breaker"]
        state.working = state.speculative["working"]
        state.add_record(record)
        state.log_compaction({"level": "speculative", "tokens_before": record.tokens_before,
                              "tokens_after": record.tokens_after, "levels": record.levels, "at": time.time(),
                              **state.speculative.get("depth", {})})
        state.speculative = {}
        _set_guard(state, turn)  # a compaction was applied
        return adopted

    def _drop_speculative(self, state: SessionState, why: str) -> None:
        """The pending background compaction forgotten, its summary (if it made one) counted as waste."""
        cost = SummaryCost.from_dict(state.speculative.get("summary"))
        state.speculative = {}
        self.wasted(state.session_id, why, cost)

    def wasted(self, session_id: str, why: str, cost: SummaryCost) -> None:
        if cost.calls:
            log.info("session %s: %d summary call(s), %d tokens, paid for nothing (%s)", session_id, cost.calls,
                     cost.tokens, why)
            if self._on_waste is not None:
                self._on_waste(why, cost.calls, cost.tokens)

    async def reactive(self, state: SessionState, turn: Turn, previous: Plan, upstream_message: str,
                       degraded: bool) -> tuple[Plan, bool]:
        """The upstream said the prompt is too long: compact once more, degrade, or give up."""
        _read_dialect(state, turn)
        guard = state.has_attempted_reactive_compact
        if self._take_speculative(state, turn) is not None:
            # A background summary of this history is ready: the reactive point starts from it.
            previous = Plan(messages=forwarded_view(state, turn)[0], tokens_out=previous.tokens_out,
                            degraded=previous.degraded)
        if (limit := planner.limit_in_error(upstream_message, turn.max_input_tokens)) is not None:
            state.learned_max_input_tokens = limit
        if turn.count_offset < 0 or turn.count_scale < 1:
            # The provider counted more than the measured difference said: trust ctxgate's count.
            turn.count_offset = state.count_offset = 0
            turn.count_scale = state.count_scale = max(1.0, turn.count_scale)
        decision = planner.after_refusal(turn, state, previous.counted_tokens(), guard, degraded, upstream_message)
        if decision.action is Action.COMPACT:
            plan = await self._compact(state, turn, previous.messages, decision.target, "reactive")
        else:
            plan = await self._exhausted(state, turn, previous.messages, decision)
        plan = await self.fitted(state, turn, plan, "reactive")
        return plan, plan.degraded

    async def fitted(self, state: SessionState, turn: Turn, plan: Plan, reason: Reason = "proactive") -> Plan:
        """`plan`, if what it forwards is within the effective budget; else, when it was compacted
        this turn, compacted once more on top of itself (`reason`: the point's); else the
        profile's degraded mode once (`on_exhausted: degrade`), and CONTEXT_EXHAUSTED if that is
        still over. Never forward what the provider will refuse: the budget is in the provider's
        count (the calibration in), and its safety margin is what ctxgate's count may be off by,
        so a request over it is a call paid for a refusal (seen: 2,372 of a 2,280 budget forwarded
        at a 2,400-token limit, counted 2,486 by the provider). Where what no level removes (the
        instructions, the task, the tools) is over the budget already, the margin cannot be had
        and the line is the context limit itself, as the planner's last fallback aims (refusing
        would refuse every turn). A compaction that ran is kept (the session transaction saves
        it): the agent's next turn starts from it."""
        budget, line = budget_of(state, turn), "effective budget"
        if plan.tokens_out is None or plan.tokens_out + turn.count_offset <= budget:
            return plan
        if turn.pinned_tokens + turn.outside_tokens() > budget:
            budget, line = limit_of(state, turn), "context limit"
            if plan.tokens_out + turn.count_offset <= budget:
                return plan
        elif plan.levels and not plan.degraded:
            # Compacted this turn and still over, where the fixed part leaves room: once more on
            # top of its own result, to the target (as a reactive point compacts what was
            # refused), before the degraded mode or a refusal. A point that kept the newest
            # messages whole, or planned before the expansion tool was reserved, lands there.
            again = await self._compact(state, turn, plan.messages, turn.target(budget, turn.config.target_ratio),
                                        reason)
            again.levels = list(dict.fromkeys([*plan.levels, *again.levels]))
            again.hints = [*plan.hints, *again.hints]
            plan = again
            if plan.counted_tokens() + turn.count_offset <= budget:
                return plan
        if turn.config.on_exhausted == "degrade" and not plan.degraded:
            plan = await self._exhausted(state, turn, plan.messages, Decision(
                Action.DEGRADE, turn.target(budget, turn.config.target_ratio)))
            if plan.counted_tokens() + turn.count_offset <= budget:
                return plan
        raise context_exhausted(f"the request needs {plan.counted_tokens() + turn.count_offset} tokens after "
                                f"compaction{' and the degraded mode' if plan.degraded else ''}, over the {line} of "
                                f"{budget}: the provider would refuse it, so it is not forwarded")

    async def with_room(self, state: SessionState, turn: Turn, plan: Plan, extra: int) -> Plan:
        """`plan` of the turn whose compaction point just began to send `extra` tokens more (the
        expansion tool, offered from a session's first point on, planned before it was reserved
        in `turn`), `fitted` with them."""
        turn.reserved_tokens += extra
        plan.tokens_out = plan.counted_tokens() + extra
        return await self.fitted(state, turn, plan)

    async def _compact(self, state: SessionState, turn: Turn, view: list[dict[str, Any]], target: int | None,
                       reason: Reason, as_is: list[dict[str, Any]] | None = None) -> Plan:
        """The planner's compaction point applied to the session. `as_is`: what the turn forwards
        if the point removes nothing (`view` with the expansion exchanges `compaction_view` left
        out; default `view`)."""
        cost = SummaryCost()
        run = await run_planner(costed(turn, cost), lambda t: planner.plan(t, state, view, target, reason, as_is=as_is))
        if run.as_is or not await run_sync(turn, lambda: summary_kept(view, run.record.messages)):
            self.wasted(state.session_id, "unused", cost)
        view = view if as_is is None else as_is
        if run.as_is:
            # Forwarded as it is, with no record and the loop guard untouched, so the upstream's
            # verdict can still be acted on. A fold that was not applied is forgotten (no
            # checkpoint follows to keep it); a failed summary still counts towards the breaker.
            state.breaker = run.breaker
            return Plan(messages=view, tokens_out=turn.counter.count_messages(with_notice(view)) + turn.fixed_tokens(),
                        hints=run.result.recovery_hints)
        _set_guard(state, turn)
        state.collapse, state.breaker, state.working = run.collapse, run.breaker, run.working
        if state.speculative:  # this point covers what it would have: its summary goes unused
            self._drop_speculative(state, "superseded")
        state.add_record(run.record)
        expand = turn.config.expand
        await self.content.put(state.tenant, state.session_id, run.cuts, expand.store_max_bytes, expand.store_ttl_s)
        result, now = run.result, run.record.created_at
        for step in result.steps:
            entry = {"level": step.level.value, "span": list(step.span), "tokens_before": step.tokens_before,
                     "tokens_after": step.tokens_after, "duration_ms": round(step.duration_ms, 3),
                     "reason": reason, "at": now}
            state.log_compaction(entry)
            if self._on_step:
                self._on_step(entry)
        state.log_compaction({"level": "chain", "tokens_before": run.record.tokens_before,
                              "tokens_after": run.record.tokens_after, "reason": reason,
                              "duration_ms": round(run.duration_ms, 3), "at": now,
                              "fits": result.fits, "hints": result.recovery_hints,
                              **(run.depth.log_fields() if run.depth is not None else {}),
                              **({"merged_notes": run.merged_notes} if run.merged_notes else {})})
        if run.merged_notes and self._on_merge:
            self._on_merge()
        levels = list(dict.fromkeys(s.level.value for s in result.steps))
        return Plan(messages=result.compressed_messages,
                    tokens_out=run.record.tokens_after + turn.fixed_tokens(), levels=levels,
                    hints=result.recovery_hints)

def fingerprints_of(messages: list[dict[str, Any]]) -> list[str]:
    return [message_fingerprint(m) for m in messages]
