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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

import orjson

from ...pipeline.autocompact import AutocompactBreaker
from ...pipeline.chain import CompressionPipeline, build_pipeline
from ...pipeline.config import PipelineConfig
from ...pipeline.collapse import CollapseStore
from ...pipeline.fingerprint import message_fingerprint
from ...pipeline.conversation import Kind, read_conversation
from ...pipeline.microcompact import LastObservationCut, MicrocompactStrategy
from ...pipeline.protocols import PLAIN, detect_dialect
from ...pipeline.refs import REF_RE, CutLog
from ...pipeline.restore import extract_working_state, shed_own_messages
from ...pipeline.snip import SnipStrategy
from ...pipeline.tokens import REPLY_PRIMING, TokenCounter
from ...pipeline.turns import leading_instructions, task_index
from ...pipeline.types import CompressionRequest, CompressionResult, Reason, RecentWindow
from ..errors import context_exhausted
from .content_store import ContentStore, MemoryContentStore
from .depth import Depth, anchored, chain_config, growth_per_turn, merge_due, plan_depth, with_window
from .state import CompactionRecord, SessionState
from .turn_budget import Plan, Turn, budget_of, limit_of

if TYPE_CHECKING:
    from .speculative import Speculator

SPECULATION_TURNS = 2
"""A background compaction starts when the session is this many turns of growth from the trigger."""
# OpenAI: "maximum context length is N tokens"; Anthropic: "prompt is too long: M tokens > N maximum".
_LIMIT_IN_ERROR = re.compile(r"maximum context length is (\d+)|> (\d+) maximum")


def _apply_records(state: SessionState, turn: Turn) -> tuple[list[dict[str, Any]], CompactionRecord | None, int]:
    """The client's messages with the longest matching record's replacement in front, that
    record, and the tokens the expansion exchanges put back add. What arrived since is
    forwarded as the client sent it: it is the recent window, with the expansion exchanges of
    its answered turns back in place."""
    hashes = turn.prefix_hashes
    for record in sorted(state.records, key=lambda r: r.prefix_len, reverse=True):
        k = record.prefix_len
        if 0 < k <= len(hashes) and hashes[k - 1] == record.prefix_hash:
            view, added = _with_expanded(state, turn, record.messages + turn.messages[k:], k, len(record.messages))
            return view, record, added
    view, added = _with_expanded(state, turn, turn.messages, 0, 0)
    return view, None, added


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


@dataclass
class ChainRun:
    """One run of the chain over a view, with the session stores it updated."""
    record: CompactionRecord
    result: Any
    collapse: dict[str, Any]
    breaker: dict[str, Any]
    working: dict[str, Any]
    duration_ms: float
    cuts: dict[str, str]
    """The originals the record's notes name by reference (empty with expansion off)."""
    depth: Depth | None = None
    """What the cost model chose, when it chose the target."""
    merged_notes: int = 0
    """Earlier compaction notes this run merged (they were over their cap): a rare, counted event."""


async def run_chain(state: SessionState, turn: Turn, view: list[dict[str, Any]], target: int | None,
                    reason: Reason) -> ChainRun:
    """The chain over `view`, as a record for the client's whole message list. `target`: where
    it lands; None: where the cost model says (`depth.plan_depth`), with the recent window it
    chooses. Reads the session's stores but changes nothing in `state` (the speculator runs it
    in the background). At most one summary is asked for."""
    cfg = turn.config
    budget = budget_of(state, turn)
    working = extract_working_state(turn.messages, cfg.restore, turn.dialect)
    collapse = CollapseStore.from_dict(state.collapse) if state.collapse else CollapseStore(cfg.collapse)
    breaker = (AutocompactBreaker.from_dict(state.breaker) if state.breaker
               else AutocompactBreaker(max_failures=cfg.autocompact.max_failures))
    summaries = 0

    async def summarize(prompt: list[dict[str, Any]]) -> str:
        nonlocal summaries
        summaries += 1
        return await turn.summarize(prompt)

    def pipeline_of(config: PipelineConfig) -> CompressionPipeline:
        return build_pipeline(config, collapse_store=collapse, breaker=breaker, summarize=summarize,
                              working_state=working, effective_budget=budget)

    pipeline = pipeline_of(cfg)
    started = time.perf_counter()
    cuts = CutLog() if cfg.expand.enabled else None
    request = CompressionRequest(messages=view, token_budget=max(1, target or 1), counter=turn.counter,
                                 reason=reason, dialect=turn.dialect, window=cfg.window(), cuts=cuts)
    depth = None
    if target is None:
        depth = plan_depth(turn, view, budget, pipeline.reserve(request))
        request = replace(request, token_budget=max(1, depth.target), window=depth.window, anchored=depth.anchored)
    else:
        request = replace(request, anchored=anchored(turn, request.conversation, budget))
    config = chain_config(cfg, request.window, merge_due(turn, request))
    if config is not cfg:
        pipeline = pipeline_of(config)
    result = await pipeline.compact(request)
    hard = budget - turn.outside_tokens()
    # Over the budget, what goes before the recent window does: the restored files first, then
    # (when no summary was asked for yet) the earlier notes, merged by this point's one summary.
    result = _shed(result, turn.counter, hard)
    if result.tokens_after > hard and request.anchored and not summaries and "autocompact" in cfg.levels:
        merging = replace(request, anchored=False)
        merged = _shed(await pipeline_of(chain_config(cfg, request.window, True)).compact(merging), turn.counter, hard)
        if merged.tokens_after < result.tokens_after:
            request, result = merging, merged
    if result.tokens_after > hard:
        # The recent window alone, cut as far as Microcompact goes, is over the budget: keeping
        # it verbatim would only forward a request the provider refuses. Only the turn in
        # progress is kept whole then; and if even that is over, its last observation is cut.
        # A summary asked for already is not asked for again over a wider span: the cheap levels
        # go on from what it left, with its note kept.
        narrow = RecentWindow(messages=1, steps=0)
        again = replace(request, window=narrow)
        config = with_window(cfg, narrow)  # Snip keeps no more than the window either
        if summaries:
            config = config.model_copy(update={"levels": [lv for lv in cfg.levels if lv != "autocompact"]})
            again = replace(again, messages=result.compressed_messages, anchored=True)
        first = result
        result = await pipeline_of(config).compact(again)
        if summaries:
            result = replace(result, steps=first.steps + result.steps,
                             recovery_hints=first.recovery_hints + result.recovery_hints)
        if result.tokens_after > hard and "microcompact" in cfg.levels:
            # Cut towards the target, not only to the limit (the turn would land at it and the next
            # turn compact again), but keeping what Microcompact keeps of any output: the newest
            # output's head and tail are where its failure lines mostly are (measured: cut to the
            # target alone, the last error line was in view a tenth less often).
            others = result.tokens_after - turn.counter.count_structured(result.compressed_messages[-1])
            keep = cfg.microcompact.head_tokens + cfg.microcompact.tail_tokens
            cut = await LastObservationCut(MicrocompactStrategy(cfg.microcompact, cfg.pin_first_user, hard)).compress(
                replace(request, messages=result.compressed_messages,
                        token_budget=min(hard, max(request.token_budget, others + keep))))
            if cut is not None:
                result = replace(cut, steps=result.steps + cut.steps,
                                 recovery_hints=result.recovery_hints + cut.recovery_hints)
        # Still over: the rest of the restored state and the notes go too (the instructions take
        # nearly all the room), rather than forward what the provider refuses.
        result = _shed(result, turn.counter, hard, everything=True)
        if result.tokens_after > hard and "snip" in cfg.levels:
            # Still over, in a conversation too short or with turns too small for Snip's minimums
            # (blocks of 5 in 10 messages): the oldest turns after the task go, under a note that
            # only counts them, down to the last message; then what ctxgate added, up to the
            # context limit itself rather than the budget's safety margin. Forwarding what the
            # provider refuses would cost the turn.
            last = SnipStrategy(cfg.snip.model_copy(update={"keep_recent": 1, "min_block": 1, "min_messages": 1,
                                                            "preview_chars": 0}), cfg.pin_first_user)
            cut = await last.compress(replace(request, messages=result.compressed_messages, token_budget=hard,
                                              window=RecentWindow(messages=1, steps=0), anchored=True))
            if cut is not None and cut.tokens_after < result.tokens_after:
                result = replace(cut, steps=result.steps + cut.steps,
                                 recovery_hints=result.recovery_hints + cut.recovery_hints)
            result = _shed(result, turn.counter, limit_of(state, turn) - turn.outside_tokens(), everything=True)
    record = CompactionRecord(
        prefix_len=len(turn.messages), prefix_hash=turn.prefix_hashes[-1],
        messages=result.compressed_messages, levels=[s.level.value for s in result.steps],
        tokens_before=turn.counter.count_messages(view),
        tokens_after=turn.counter.count_messages(result.compressed_messages), created_at=time.time(),
        counted_by=turn.counter.name)
    return ChainRun(record, result, collapse.to_dict(), breaker.to_dict(), working.to_dict(),
                    (time.perf_counter() - started) * 1000, _named(cuts, record.messages), depth,
                    0 if request.anchored else _merged(view, record.messages, cfg.pin_first_user, turn.dialect))


def _shed(result: CompressionResult, counter: TokenCounter, limit: int, everything: bool = False
          ) -> CompressionResult:
    """`result` without those of ctxgate's own messages it cannot afford under `limit`
    (`shed_own_messages`); as it is if it fits, or does not fit even without them."""
    if result.tokens_after <= limit:
        return result
    shed = shed_own_messages(result.compressed_messages, counter, limit, everything)
    if shed is None:
        return result
    return replace(result, compressed_messages=shed, tokens_after=counter.count_messages(shed))


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
            self.speculator.resume(state, turn, lambda then: self._view(state, then)[0])
        retried = bool(state.records) and state.records[-1].prefix_hash == turn.prefix_hashes[-1]
        if tokens <= cfg.trigger_ratio * budget or retried:
            # Under the trigger; or exactly the request compacted last (a client's retry):
            # forwarded as compacted then, over the trigger or not, with no second compaction.
            ratio = cfg.autocompact.speculative_ratio
            if ratio is not None and tokens > ratio * budget and self.speculator is not None and not retried:
                self._speculate(state, turn, view, tokens, budget)
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
        return await self._compact(state, turn, view, target, "proactive")

    def _speculate(self, state: SessionState, turn: Turn, view: list[dict[str, Any]], tokens: int,
                   budget: int) -> None:
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
            self.speculator.start(state, turn, view, turn.target(budget, aim))
        elif tokens + SPECULATION_TURNS * growth_per_turn(turn) > cfg.trigger_ratio * budget:
            self.speculator.start(state, turn, view, None)

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
        record = CompactionRecord(**pending)
        hashes = turn.prefix_hashes
        k = record.prefix_len
        if not (0 < k <= len(hashes) and hashes[k - 1] == record.prefix_hash):
            state.speculative = {}
            return None
        view, _ = _with_expanded(state, turn, record.messages + turn.messages[k:], k, len(record.messages))
        tokens = turn.counter.count_messages(view) + turn.outside_tokens()
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
                       reason: Reason) -> Plan:
        run = await run_chain(state, turn, view, target, reason)
        fits = turn.counter.count_messages(view) + turn.outside_tokens() <= budget_of(state, turn)
        if not run.result.steps and reason == "proactive" and fits:
            # Nothing could be removed (all of it is pinned or recent): forwarded as it is, with
            # no record and the loop guard untouched, so the upstream's verdict can still be acted on.
            # A fold that was not applied is forgotten (no checkpoint follows to keep it); a failed
            # summary still counts towards the breaker.
            state.breaker = run.breaker
            return Plan(messages=view, tokens_out=turn.counter.count_messages(view) + turn.fixed_tokens(),
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


def _merged(view: list[dict[str, Any]], out: list[dict[str, Any]], pin_first_user: bool, dialect: str) -> int:
    """How many of the notes earlier points left after the task are gone from `out`."""
    start, end = read_conversation(view, dialect).anchor(pin_first_user)
    kept = {orjson.dumps(m) for m in out}
    return sum(1 for m in view[start:end] if orjson.dumps(m) not in kept)


def _named(cuts: CutLog | None, messages: list[dict[str, Any]]) -> dict[str, str]:
    """The originals the compacted messages still name, directly or through an original they
    name (a snip note that Autocompact then summarised): a level tried and not applied, or a
    first pass the chain ran again, leaves references nothing points to."""
    if cuts is None or not cuts.originals:
        return {}
    kept: dict[str, str] = {}
    named = REF_RE.findall(orjson.dumps(messages).decode())
    while named:
        ref = named.pop()
        if ref not in kept and ref in cuts.originals:
            kept[ref] = cuts.originals[ref]
            named += REF_RE.findall(kept[ref])
    return kept


def record_tokens(record: CompactionRecord, counter: TokenCounter) -> int:
    """A record's messages as `counter` counts them: its stored count when it was made with
    that counter (every turn after a compaction re-applies the record: no recount)."""
    if record.counted_by == counter.name:
        return record.tokens_after
    return counter.count_messages(record.messages)


def fingerprints_of(messages: list[dict[str, Any]]) -> list[str]:
    return [message_fingerprint(m) for m in messages]
