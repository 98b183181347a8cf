"""One run of the chain over a session's view: the depth the cost model chooses, the
pipeline with the session's stores and at most one summary call, the fallbacks while the
result is over the budget, and the record a compaction point keeps. It reads the session's
state and changes nothing in it: the compactor applies the run at the trigger, the
speculator in the background."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import orjson

from ctxgate.pipeline.autocompact import AutocompactBreaker
from ctxgate.pipeline.chain import CompressionPipeline, build_pipeline
from ctxgate.pipeline.collapse import CollapseStore
from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.conversation import read_conversation
from ctxgate.pipeline.notes import is_summary_note, merged_note, requoted, with_notice
from ctxgate.pipeline.refs import REF_RE, CutLog, render_span
from ctxgate.pipeline.restore import extract_working_state
from ctxgate.pipeline.request import CompressionRequest
from ctxgate.pipeline.types import CompressionResult, Reason
from .depth import Depth, anchored, chain_config, merge_due, plan_depth
from .over_budget import OverBudget
from .state import CompactionRecord, SessionState
from .turn_budget import Turn, budget_of, limit_of


DEFERRED_HINT = "deferred: no cut frees the least gain yet; forwarded as it is"
"""The hint a deferred run leaves on the turn's plan."""


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
                    reason: Reason, may_defer: bool = False) -> ChainRun:
    """The chain over `view`, as a record for the client's whole message list. `target`: where
    it lands; None: where the cost model says (`depth.plan_depth`), with the recent window it
    chooses. Reads the session's stores but changes nothing in `state` (the speculator runs it
    in the background). At most one summary is asked for. `may_defer` (the caller knows the
    request as it would be forwarded fits the budget): a narrowed point that cannot free the
    least gain compacts nothing (`deferred`)."""
    cfg = turn.config
    budget = budget_of(state, turn)
    view = requoted(view)  # a record made before notes were quoted: its prompt changes here, once
    working = extract_working_state(turn.messages, cfg.restore, turn.dialect)
    collapse = CollapseStore.from_dict(state.collapse) if state.collapse else CollapseStore(cfg.collapse)
    breaker = (AutocompactBreaker.from_dict(state.breaker) if state.breaker
               else AutocompactBreaker(max_failures=cfg.autocompact.max_failures))
    summaries = 0

    async def summarize(prompt: list[dict[str, Any]]) -> str:
        nonlocal summaries
        summaries += 1
        return await turn.summarize(prompt)

    def pipeline_of(config: PipelineConfig, store: CollapseStore | None = None) -> CompressionPipeline:
        """The chain with `config` and the session's stores (`store`: another Collapse store)."""
        return build_pipeline(config, collapse_store=store or collapse, breaker=breaker, summarize=summarize,
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
    folded = 0
    if merge_due(turn, request):
        request, folded = _fold_notes(request, cfg.pin_first_user)
    config = chain_config(cfg, request.window, merge_due(turn, request))
    if config is not cfg:
        pipeline = pipeline_of(config)
    if depth is not None and depth.narrowed and "autocompact" in config.levels:
        # The older window cut once by the cheap levels, when that buys a cache break its worth
        # and fits the budget with what the point restores (over it, the fallbacks would shed
        # the restored state: measured, touched files and the last error were lost that way);
        # else the configured window as far as every level takes it, unless that lands higher.
        cheap = config.model_copy(update={"levels": [lv for lv in config.levels if lv != "autocompact"]})
        trial_collapse = CollapseStore.from_dict(collapse.to_dict())
        trial = await pipeline_of(cheap, trial_collapse).compact(request)
        def size(messages: list[dict[str, Any]]) -> int:  # as forwarded: the notice its quoted notes bring in
            return turn.counter.count_messages(with_notice(messages))

        kept = size(trial.compressed_messages)
        if size(view) - kept >= cfg.cost.least_gain(budget) and kept <= budget - turn.outside_tokens():
            result, collapse = trial, trial_collapse
        elif may_defer:
            # Nothing older than the newest step is worth a cache break yet, and the request
            # still fits the budget: forwarded as it is, so the prefix stays cached, until
            # enough has grown behind the newest step for one cut to free the least gain.
            return _deferred(state, turn, view, working, started, depth)
        else:
            wide = replace(request, window=cfg.window())
            result = await pipeline_of(chain_config(cfg, wide.window, merge_due(turn, wide))).compact(wide)
            if size(result.compressed_messages) <= kept:
                request, depth = wide, replace(depth, window=wide.window, narrowed=False)
            else:
                result, collapse = trial, trial_collapse
    else:
        result = await pipeline.compact(request)
    fallbacks = OverBudget(cfg, turn.counter, pipeline_of, lambda: summaries, budget - turn.outside_tokens(),
                           limit_of(state, turn) - turn.outside_tokens())
    request, result = await fallbacks.fit(request, result)
    record = CompactionRecord(
        prefix_len=len(turn.messages), prefix_hash=turn.prefix_hashes[-1],
        messages=result.compressed_messages, levels=[s.level.value for s in result.steps],
        tokens_before=turn.counter.count_messages(with_notice(view)),
        # With the notice its quoted notes bring (added when forwarded): what the provider counts.
        tokens_after=turn.counter.count_messages(with_notice(result.compressed_messages)), created_at=time.time(),
        counted_by=turn.counter.name)
    return ChainRun(record, result, collapse.to_dict(), breaker.to_dict(), working.to_dict(),
                    (time.perf_counter() - started) * 1000, _named(cuts, record.messages), depth,
                    folded or (0 if request.anchored else _merged(view, record.messages, cfg.pin_first_user,
                                                                  turn.dialect)))


def _fold_notes(request: CompressionRequest, pin_first_user: bool) -> tuple[CompressionRequest, int]:
    """Earlier notes due to be merged, when none of them is a summary: folded into one note that
    names their text (kept for expansion), with no summary call, and the point anchored on it.
    Snip's and Collapse's notes are previews and references: a summary of them would pay the
    output price for what the references already give back (a lone note is folded too: the
    fold drops its previews). Left to Autocompact, which merges them with the new span (the
    request unchanged): notes with a summary among them, and any notes when expansion is off
    (the fold's reference is what keeps their content). A fold folded again later names the
    earlier fold's text, which names its own reference: one expansion per level."""
    start, end = request.conversation.anchor(pin_first_user)
    notes = request.messages[start:end]
    if request.cuts is None or any(is_summary_note(m) for m in notes):
        return request, 0
    folded = request.messages[:start] + [merged_note(len(notes), request.cuts.keep(render_span(notes)))] \
        + request.messages[end:]
    return replace(request.with_messages(folded), anchored=True), len(notes)


def _deferred(state: SessionState, turn: Turn, view: list[dict[str, Any]], working: Any, started: float,
              depth: Depth) -> ChainRun:
    """A run that compacts nothing (no steps, `DEFERRED_HINT`): the compactor forwards the
    request as it is."""
    tokens = turn.counter.count_messages(with_notice(view))
    result = CompressionResult(compressed_messages=view, tokens_freed=0, level_used=None, tokens_after=tokens,
                               recovery_hints=[DEFERRED_HINT])
    record = CompactionRecord(prefix_len=len(turn.messages), prefix_hash=turn.prefix_hashes[-1], messages=view,
                              levels=[], tokens_before=tokens, tokens_after=tokens, created_at=time.time(),
                              counted_by=turn.counter.name)
    return ChainRun(record, result, state.collapse, state.breaker, working.to_dict(),
                    (time.perf_counter() - started) * 1000, {}, depth)


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
