"""The pipeline, applied to a stateless client that resends its whole history.

Each turn: re-apply the longest stored compaction record whose prefix hash matches the
client's messages (so the compressed prefix is byte-identical turn after turn and an
Autocompact summary is paid for once), then run the chain only if what is left is over
the trigger. The loop guard (`has_attempted_reactive_compact`) is described in
docs/compaction.md (the loop guard and CONTEXT_EXHAUSTED).
"""
from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from ctxgate.pipeline.conversation import Kind, read_conversation
from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.notes import with_notice
from ctxgate.pipeline.protocols import PLAIN, detect_dialect
from ctxgate.pipeline.tokens import REPLY_PRIMING, TokenCounter
from ctxgate.pipeline.turns import leading_instructions, task_index
from ctxgate.pipeline.types import Reason
from ..errors import context_exhausted
from .chain_run import run_chain
from .content_store import ContentStore, MemoryContentStore
from .depth import growth_per_turn
from .state import CompactionRecord, SessionState
from .turn_budget import Plan, Turn, budget_of, limit_of

if TYPE_CHECKING:
    from .speculative import Speculator

SPECULATION_TURNS = 2
"""A background compaction starts when the session is this many turns of growth from the trigger."""
# OpenAI: "maximum context length is N tokens"; Anthropic: "prompt is too long: M tokens > N maximum".
_LIMIT_IN_ERROR = re.compile(r"maximum context length is (\d+)|> (\d+) maximum")


def _apply_records(state: SessionState, turn: Turn,
                   exchanges: bool = True) -> tuple[list[dict[str, Any]], CompactionRecord | None, int]:
    """The client's messages with the longest matching record's replacement in front, that
    record, and the tokens the expansion exchanges put back add. What arrived since is
    forwarded as the client sent it: it is the recent window, with the expansion exchanges of
    its answered turns back in place (unless `exchanges` is False: `compaction_view`)."""
    hashes = turn.prefix_hashes
    for record in sorted(state.records, key=lambda r: r.prefix_len, reverse=True):
        k = record.prefix_len
        if 0 < k <= len(hashes) and hashes[k - 1] == record.prefix_hash:
            view = record.messages + turn.messages[k:]
            if not exchanges:
                return view, record, 0
            view, added = _with_expanded(state, turn, view, k, len(record.messages))
            return view, record, added
    if not exchanges:
        return list(turn.messages), None, 0
    view, added = _with_expanded(state, turn, turn.messages, 0, 0)
    return view, None, added


def compaction_view(state: SessionState, turn: Turn) -> list[dict[str, Any]]:
    """What a compaction point compacts: the view without the expansion exchanges of earlier
    turns. Each result is a copy of an original still stored under the reference a note
    names; compacting it again would store a copy of that copy under a new reference, with a
    preview naming references the model had already expanded, and a model that expands what
    it sees would ask for them all over again (measured on check_pipeline's run: the notes
    of one point held the calls of the last, and the next point came a turn sooner). The
    point breaks the cached prefix anyway, and what was expanded can be asked for again."""
    return _apply_records(state, turn, exchanges=False)[0]


def _with_expanded(state: SessionState, turn: Turn, view: list[dict[str, Any]], covered: int,
                   replaced_by: int) -> tuple[list[dict[str, Any]], int]:
    """`view` (the client's first `covered` messages replaced by `replaced_by` others) with each
    expansion exchange after the client's message it followed, when that message is after
    what is replaced and the history up to it is unchanged; and the tokens they add. The
    forwarded request then starts with the previous turn's last follow-up, as the provider
    cached it."""
    hashes = turn.prefix_hashes
    found = [e for e in state.expanded if covered <= e["prefix_len"] <= len(hashes)
             and hashes[e["prefix_len"] - 1] == e["prefix_hash"]]
    if not found:
        return view, 0
    out = list(view)
    for entry in sorted(found, key=lambda e: e["prefix_len"], reverse=True):
        at = entry["prefix_len"] - covered + replaced_by
        out[at:at] = entry["messages"]
    added = turn.counter.count_messages([m for e in found for m in e["messages"]]) - REPLY_PRIMING
    return out, added


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


def _refuse_infeasible(state: SessionState, turn: Turn) -> None:
    """No compaction can bring a request under the limit when what every level keeps (the
    leading instructions, the task statement and the last message) is over it alone: say so
    before any upstream call, rather than forward what the provider will refuse. A last
    message that is an observation can still be cut (`LastObservationCut`)."""
    messages = turn.messages
    essential = set(range(leading_instructions(messages)))
    if read_conversation(messages, turn.dialect).kind(len(messages) - 1) is not Kind.OBSERVATION:
        essential.add(len(messages) - 1)
    task = task_index(messages)
    if task is not None:
        essential.add(task)
    tokens = turn.counter.count_messages([messages[i] for i in sorted(essential)]) + turn.outside_tokens()
    limit = limit_of(state, turn)
    if tokens > limit:
        raise context_exhausted(f"the system prompt, the task and the last message alone need {tokens} tokens, over "
                                f"the context limit of {limit}: no compaction can make this request fit")


class Compactor:
    def __init__(self, on_step: Callable[[dict[str, Any]], None] | None = None,
                 speculator: "Speculator | None" = None, content: ContentStore | None = None,
                 on_merge: Callable[[], None] | None = None) -> None:
        self._on_step = on_step
        self._on_merge = on_merge
        """Called when a compaction point merged the earlier notes (a metric counts it)."""
        self.speculator = speculator
        self.content: ContentStore = content or MemoryContentStore()
        """Where the originals a compaction cut are kept for expansion."""

    async def prepare(self, state: SessionState, turn: Turn) -> Plan:
        budget = budget_of(state, turn)
        if state.has_attempted_reactive_compact and state.guard_request != turn.prefix_hashes[-1]:
            state.has_attempted_reactive_compact = False  # a new turn, not a retry of the refused one
        view, tokens = self._view(state, turn)
        cfg = turn.config
        watermark = cfg.watermark_ratio()
        if state.speculation or tokens > watermark * budget:
            _read_dialect(state, turn)  # only a turn that may compact reads the conversation
        if state.speculation and self.speculator is not None:
            self.speculator.resume(state, turn, lambda then: compaction_view(state, then))
        retried = bool(state.records) and state.records[-1].prefix_hash == turn.prefix_hashes[-1]
        if tokens <= cfg.trigger_ratio * budget or retried:
            # Under the trigger; or exactly the request compacted last (a client's retry):
            # forwarded as compacted then, over the trigger or not, with no second compaction.
            ratio = cfg.autocompact.speculative_ratio
            if ratio is not None and tokens > ratio * budget and self.speculator is not None and not retried:
                self._speculate(state, turn, tokens, budget)
            return Plan(messages=view, tokens_out=tokens - turn.count_offset)
        _refuse_infeasible(state, turn)
        if state.has_attempted_reactive_compact:
            # The loop guard: this very request was compacted already, without a successful
            # reply since. Not a second ordinary compaction: the degraded mode, or CONTEXT_EXHAUSTED.
            if cfg.on_exhausted == "degrade":
                return await self._degrade(state, turn, view, turn.target(budget, cfg.target_ratio))
            raise context_exhausted(f"the request needs {tokens} tokens of an effective budget of {budget}, and a "
                                    "compaction already ran without a successful reply since")
        if self.speculator is not None:
            await self.speculator.settle(state)
        adopted = self._adopt_speculative(state, turn, budget)
        if adopted is not None:
            return adopted
        target = turn.target(budget, cfg.target_ratio) if cfg.cost.depth == "target" else None
        return await self._compact(state, turn, compaction_view(state, turn), target, "proactive", as_is=view)

    def _speculate(self, state: SessionState, turn: Turn, tokens: int, budget: int) -> None:
        """Start the compaction the trigger will ask for in the background. With the cost model,
        only once the session is within `SPECULATION_TURNS` turns of its growth of the trigger:
        started earlier, it is stale by the time it is needed and its summary paid twice."""
        assert self.speculator is not None
        cfg = turn.config
        if cfg.cost.depth == "target":
            # Adopted turns later with what arrived since on top: it aims lower by the growth
            # from the watermark to the trigger, to leave the room a compaction then would.
            ratio = cfg.watermark_ratio()
            aim = max(cfg.target_ratio / 2, cfg.target_ratio - (cfg.trigger_ratio - ratio))
            self.speculator.start(state, turn, compaction_view(state, turn), turn.target(budget, aim))
        elif tokens + SPECULATION_TURNS * growth_per_turn(turn) > cfg.trigger_ratio * budget:
            self.speculator.start(state, turn, compaction_view(state, turn), None)

    @staticmethod
    def _view(state: SessionState, turn: Turn) -> tuple[list[dict[str, Any]], int]:
        """What to forward as the records have it, and its size as the provider counts it:
        the record's own count plus the turn's count of what arrived since, O(new messages)."""
        view, record, expanded = _apply_records(state, turn)
        if record is None:
            return view, turn.message_tokens() + expanded + turn.outside_tokens()
        return view, (record_tokens(record, turn.counter) + turn.message_tokens(record.prefix_len) - REPLY_PRIMING
                      + expanded + turn.outside_tokens())

    def _adopt_speculative(self, state: SessionState, turn: Turn, budget: int) -> Plan | None:
        """Promote the background compaction to a record if it still matches the client's
        history and still brings the session below the watermark where a speculation starts.
        One made several turns ago that now leaves less room than that would only bring the
        next compaction point (a prefix change and a summary) closer than compacting afresh."""
        pending = state.speculative.get("record")
        if not pending:
            return None
        record = CompactionRecord.from_dict(pending)
        hashes = turn.prefix_hashes
        k = record.prefix_len
        if not (0 < k <= len(hashes) and hashes[k - 1] == record.prefix_hash):
            state.speculative = {}
            return None
        view, _ = _with_expanded(state, turn, record.messages + turn.messages[k:], k, len(record.messages))
        tokens = turn.counter.count_messages(with_notice(view)) + turn.outside_tokens()
        cfg = turn.config
        if tokens > cfg.watermark_ratio() * budget:
            state.speculative = {}
            state.speculation_wasted += 1
            return None
        state.collapse, state.breaker = state.speculative["collapse"], state.speculative["breaker"]
        state.working = state.speculative["working"]
        state.add_record(record)
        state.log_compaction({"level": "speculative", "tokens_before": record.tokens_before,
                              "tokens_after": record.tokens_after, "levels": record.levels, "at": time.time(),
                              **state.speculative.get("depth", {})})
        state.speculative = {}
        _set_guard(state, turn)  # a compaction was applied
        return Plan(messages=view, tokens_out=tokens - turn.count_offset, levels=list(dict.fromkeys(record.levels)),
                    hints=["speculative: applied the compaction prepared in the background"])

    async def reactive(self, state: SessionState, turn: Turn, previous: Plan, upstream_message: str,
                       degraded: bool) -> tuple[Plan, bool]:
        """The upstream said the prompt is too long: compact once more, degrade, or give up."""
        _read_dialect(state, turn)
        if found := _LIMIT_IN_ERROR.search(upstream_message):
            limit = int(found.group(1) or found.group(2))
            if 0 < limit < turn.max_input_tokens:
                state.learned_max_input_tokens = limit
        if turn.count_offset < 0 or turn.count_scale < 1:
            # The provider counted more than the measured difference said: trust ctxgate's count.
            turn.count_offset = state.count_offset = 0
            turn.count_scale = state.count_scale = max(1.0, turn.count_scale)
        budget = budget_of(state, turn)
        ratio = turn.config.target_ratio
        target = min(turn.target(budget, ratio), int(previous.counted_tokens() * ratio) - turn.fixed_tokens())
        if not state.has_attempted_reactive_compact:
            return await self._compact(state, turn, previous.messages, target, "reactive"), False
        if turn.config.on_exhausted == "degrade" and not degraded:
            return await self._degrade(state, turn, previous.messages, target), True
        raise context_exhausted(f"the upstream refused {previous.counted_tokens()} tokens as too long after a "
                                f"compaction already ran: {upstream_message[:200]}")

    async def _degrade(self, state: SessionState, turn: Turn, view: list[dict[str, Any]], target: int) -> Plan:
        """The degraded mode (`on_exhausted: degrade`, docs/compaction.md): one forced Autocompact
        keeping only the newest messages."""
        config = turn.config.model_copy(update={"levels": ["autocompact"]})
        plan = await self._compact(state, replace(turn, config=config), view, target, "degrade")
        plan.degraded = True
        return plan

    async def _compact(self, state: SessionState, turn: Turn, view: list[dict[str, Any]], target: int | None,
                       reason: Reason, as_is: list[dict[str, Any]] | None = None) -> Plan:
        """`as_is`: what the turn forwards if the chain removes nothing (`view` with the
        expansion exchanges `compaction_view` left out; default `view`)."""
        view_as_is = view if as_is is None else as_is
        fits = turn.counter.count_messages(with_notice(view_as_is)) + turn.outside_tokens() <= budget_of(state, turn)
        run = await run_chain(state, turn, view, target, reason, may_defer=fits and reason == "proactive")
        view = view_as_is
        if not run.result.steps and reason == "proactive" and fits:
            # Nothing could be removed (all of it is pinned or recent), or nothing worth a cache
            # break yet (a deferred run): forwarded as it is, with no record and the loop guard
            # untouched, so the upstream's verdict can still be acted on.
            # A fold that was not applied is forgotten (no checkpoint follows to keep it); a failed
            # summary still counts towards the breaker.
            state.breaker = run.breaker
            return Plan(messages=view, tokens_out=turn.counter.count_messages(with_notice(view)) + turn.fixed_tokens(),
                        hints=run.result.recovery_hints)
        _set_guard(state, turn)
        state.collapse, state.breaker, state.working = run.collapse, run.breaker, run.working
        state.speculative = {}
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


def record_tokens(record: CompactionRecord, counter: TokenCounter) -> int:
    """A record's messages as `counter` counts them: its stored count when it was made with
    that counter (every turn after a compaction re-applies the record: no recount)."""
    if record.counted_by == counter.name:
        return record.tokens_after
    return counter.count_messages(with_notice(record.messages))


def fingerprints_of(messages: list[dict[str, Any]]) -> list[str]:
    return [message_fingerprint(m) for m in messages]
