"""The planner: what one compaction point of a session does, decided over its messages and
plain data (docs/compaction.md). The engine loads the session, asks here, applies the plan,
journals it and forwards; every kind of compaction (proactive, reactive, degraded,
speculative) is planned by `plan`, the one entry point; `decide` and `after_refusal` say
which kind a turn needs, `adoption` whether a background compaction still serves.

`plan` runs the chain (pipeline/chain.py) with the depth the cost model chooses
(pipeline/depth.py), narrows the recent window, defers a point that frees too little, folds
earlier notes, gives up what the fallbacks give up while still over the budget
(pipeline/over_budget.py), and returns the record the point keeps. The Autocompact call is
the turn's `summarize`, passed in by the engine; at most one is made per point.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import orjson

from .autocompact import AutocompactBreaker
from .budget import Turn, context_limit, effective_budget
from .chain import CompressionPipeline, build_pipeline
from .collapse import CollapseStore
from .config import PipelineConfig
from .conversation import Kind, read_conversation
from .depth import Depth, anchored, chain_config, growth_per_turn, merge_due, plan_depth
from .ledger import covered_steps, merged
from .notes import is_summary_note, requoted, with_notice
from .over_budget import OverBudget
from .records import CompactionRecord
from .refs import REF_RE, CutLog
from .request import CompressionRequest
from .restore import ActiveRestore, extract_working_state
from .stable_head import best_match, match, with_stable_head
from .tail import kept_for_edits
from .turns import leading_instructions, task_index
from .types import CompressionResult, Reason
from .views import SessionFacts, with_expanded

SPECULATION_TURNS = 2
"""A background compaction starts when the session is this many turns of growth from the trigger."""
# OpenAI: "maximum context length is N tokens"; Anthropic: "prompt is too long: M tokens > N maximum".
_LIMIT_IN_ERROR = re.compile(r"maximum context length is (\d+)|> (\d+) maximum")


class Action(Enum):
    FORWARD = "forward"
    """Forward the view as the records have it (under the trigger, or the request compacted last)."""
    COMPACT = "compact"
    DEGRADE = "degrade"
    """The degraded mode (`on_exhausted: degrade`): one forced Autocompact (`degraded`)."""
    EXHAUSTED = "exhausted"
    """CONTEXT_EXHAUSTED: no compaction can help, or one ran without a successful reply since."""


@dataclass(frozen=True)
class Decision:
    action: Action
    target: int | None = None
    """Where the compaction lands; None: where the cost model says (`plan`)."""
    speculate: bool = False
    """FORWARD: start the compaction the trigger will ask for in the background, to `target`."""
    why: str = ""
    """EXHAUSTED: what the client is told."""


def may_compact(turn: Turn, facts: SessionFacts, tokens: int) -> bool:
    """Whether a turn whose view counts `tokens` is over the watermark, where a compaction may
    start: only such a turn needs its conversation read."""
    return tokens > turn.config.watermark_ratio() * effective_budget(turn, facts.learned_max_input_tokens)


def decide(turn: Turn, facts: SessionFacts, tokens: int, guard: bool, speculator: bool) -> Decision:
    """What a turn whose view counts `tokens` needs: `guard`, the loop guard set by this very
    request (docs/compaction.md, the loop guard); `speculator`, whether background
    compaction runs in this gateway."""
    cfg = turn.config
    budget = effective_budget(turn, facts.learned_max_input_tokens)
    retried = bool(facts.records) and facts.records[-1].prefix_hash == turn.prefix_hashes[-1]
    if tokens <= cfg.trigger_ratio * budget or retried:
        # Under the trigger; or exactly the request compacted last (a client's retry):
        # forwarded as compacted then, over the trigger or not, with no second compaction.
        ratio = cfg.autocompact.speculative_ratio
        if ratio is not None and tokens > ratio * budget and speculator and not retried:
            return _speculation(turn, tokens, budget)
        return Decision(Action.FORWARD)
    if (why := infeasible(turn, context_limit(turn, facts.learned_max_input_tokens))) is not None:
        return Decision(Action.EXHAUSTED, why=why)
    if guard:
        # The loop guard: this very request was compacted already, without a successful
        # reply since. Not a second ordinary compaction: the degraded mode, or CONTEXT_EXHAUSTED.
        if cfg.on_exhausted == "degrade":
            return Decision(Action.DEGRADE, turn.target(budget, cfg.target_ratio))
        return Decision(Action.EXHAUSTED, why=f"the request needs {tokens} tokens of an effective budget of {budget}, "
                                              "and a compaction already ran without a successful reply since")
    return Decision(Action.COMPACT, turn.target(budget, cfg.target_ratio) if cfg.cost.depth == "target" else None)


def _speculation(turn: Turn, tokens: int, budget: int) -> Decision:
    """Start the compaction the trigger will ask for in the background. With the cost model,
    only once the session is within `SPECULATION_TURNS` turns of its growth of the trigger:
    started earlier, it is stale by the time it is needed and its summary paid twice."""
    cfg = turn.config
    if cfg.cost.depth == "target":
        # Adopted turns later with what arrived since on top: it aims lower by the growth
        # from the watermark to the trigger, to leave the room a compaction then would.
        ratio = cfg.watermark_ratio()
        aim = max(cfg.target_ratio / 2, cfg.target_ratio - (cfg.trigger_ratio - ratio))
        return Decision(Action.FORWARD, turn.target(budget, aim), speculate=True)
    if tokens + SPECULATION_TURNS * growth_per_turn(turn) > cfg.trigger_ratio * budget:
        return Decision(Action.FORWARD, None, speculate=True)
    return Decision(Action.FORWARD)


def infeasible(turn: Turn, limit: int) -> str | None:
    """Why no compaction can bring the request under `limit`, when what every level keeps (the
    leading instructions, the task statement and the last message) is over it alone: said
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
    if tokens <= limit:
        return None
    return (f"the system prompt, the task and the last message alone need {tokens} tokens, over "
            f"the context limit of {limit}: no compaction can make this request fit")


def limit_in_error(message: str, max_input_tokens: int) -> int | None:
    """A smaller context limit the upstream's refusal names, if any."""
    if found := _LIMIT_IN_ERROR.search(message):
        limit = int(found.group(1) or found.group(2))
        if 0 < limit < max_input_tokens:
            return limit
    return None


def after_refusal(turn: Turn, facts: SessionFacts, refused: int, guard: bool, degraded: bool,
                  upstream_message: str) -> Decision:
    """The upstream refused `refused` tokens as too long: compact once more, degrade, or give up."""
    budget = effective_budget(turn, facts.learned_max_input_tokens)
    ratio = turn.config.target_ratio
    target = min(turn.target(budget, ratio), int(refused * ratio) - turn.fixed_tokens())
    if not guard:
        return Decision(Action.COMPACT, target)
    if turn.config.on_exhausted == "degrade" and not degraded:
        return Decision(Action.DEGRADE, target)
    return Decision(Action.EXHAUSTED, why=f"the upstream refused {refused} tokens as too long after a "
                                          f"compaction already ran: {upstream_message[:200]}")


def degraded(turn: Turn) -> Turn:
    """The turn as the degraded mode compacts it (docs/compaction.md): one forced Autocompact
    keeping only the newest messages."""
    return replace(turn, config=turn.config.model_copy(update={"levels": ["autocompact"]}))


@dataclass(frozen=True)
class Adoption:
    """Whether a background compaction's record serves this turn."""
    view: list[dict[str, Any]] | None
    """What to forward with it; None: it does not serve."""
    tokens: int = 0
    wasted: bool = False
    """It matched, but leaves too little room: this session grows too fast for speculation."""


def adoption(turn: Turn, facts: SessionFacts, record: CompactionRecord) -> Adoption:
    """A background compaction serves if it still matches the client's history and still brings
    the session below the watermark where a speculation starts. One made several turns ago that
    now leaves less room than that would only bring the next compaction point (a prefix change
    and a summary) closer than compacting afresh."""
    found = match(record, turn)  # whole, or by its stable part (pipeline/stable_head.py)
    if found is None:
        return Adoption(None)
    view, _ = with_expanded(facts, turn, found.head + turn.messages[found.covered:], found.covered, len(found.head))
    tokens = turn.counter.count_messages(with_notice(view)) + turn.outside_tokens()
    if tokens > turn.config.watermark_ratio() * effective_budget(turn, facts.learned_max_input_tokens):
        return Adoption(None, wasted=True)
    return Adoption(view, tokens)


DEFERRED_HINT = "deferred: no cut frees the least gain yet; forwarded as it is"
"""The hint a deferred point leaves on the turn's plan."""


@dataclass
class CompactionPlan:
    """One compaction point as planned: the record it keeps and the session stores it updated."""
    record: CompactionRecord
    result: CompressionResult
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
    as_is: bool = False
    """Nothing is removed (all of it is pinned or recent), or nothing worth a cache break yet (a
    deferred point), and the request fits: forwarded as it is, with no record."""


async def plan(turn: Turn, facts: SessionFacts, view: list[dict[str, Any]], target: int | None,
               reason: Reason, as_is: list[dict[str, Any]] | None = None, fits: bool | None = None) -> CompactionPlan:
    """The compaction point over `view`, as a record for the client's whole message list.
    `target`: where it lands; None: where the cost model says (`depth.plan_depth`), with the
    recent window it chooses. `as_is`: what the turn forwards if nothing is removed (default
    `view`); `fits`: whether that fits the budget (default: counted). A proactive point whose
    request fits may wait: a narrowed point that cannot free the least gain compacts nothing
    (deferred). Reads the session's stores and changes nothing (a background compaction is
    planned beside the session). At most one summary is asked for."""
    cfg = turn.config
    budget = effective_budget(turn, facts.learned_max_input_tokens)
    if fits is None:
        fits = turn.counter.count_messages(with_notice(view if as_is is None else as_is)) \
            + turn.outside_tokens() <= budget
    may_defer = fits and reason == "proactive"
    view = requoted(view)  # a record made before notes were quoted: its prompt changes here, once
    working = extract_working_state(turn.messages, cfg.restore, turn.dialect)
    collapse = CollapseStore.from_dict(facts.collapse) if facts.collapse else CollapseStore(cfg.collapse)
    breaker = (AutocompactBreaker.from_dict(facts.breaker) if facts.breaker
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
    # The steps the applied record stood for are numbered on from, even where it kept no note.
    applied = best_match(facts.records, turn)
    task = _client_task(turn)
    request = CompressionRequest(messages=view, token_budget=max(1, target or 1), counter=turn.counter,
                                 reason=reason, dialect=turn.dialect, window=cfg.window(), cuts=cuts,
                                 steps_before=applied.record.steps if applied is not None else 0, task=task)
    pinned = frozenset({task}) if task is not None and cfg.pin_first_user else frozenset()
    request = replace(request, keep=kept_for_edits(request.conversation, turn.counter, budget - turn.outside_tokens())
                      | pinned)
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
            return _deferred(facts, turn, view, working, started, depth)
        else:
            wide = replace(request, window=cfg.window())
            paid = summaries
            result = await pipeline_of(chain_config(cfg, wide.window, merge_due(turn, wide))).compact(wide)
            landed = size(result.compressed_messages)
            # A summary paid for by the wide run is kept while its result fits the budget, even a
            # little above the trial's: thrown away, it was paid for nothing (measured on
            # tau-bench at a quarter of its size: 71 of 86 summaries never sent were these).
            if landed <= kept or (summaries > paid and landed <= budget - turn.outside_tokens()
                                  and _summarised(view, result.compressed_messages)):
                request, depth = wide, replace(depth, window=wide.window, narrowed=False)
            else:
                result, collapse = trial, trial_collapse
    else:
        result = await pipeline.compact(request)
    fallbacks = OverBudget(cfg, turn.counter, pipeline_of, lambda: summaries, budget - turn.outside_tokens(),
                           context_limit(turn, facts.learned_max_input_tokens) - turn.outside_tokens(),
                           ActiveRestore(cfg.restore, working))
    numbered = request  # its steps numbered as the levels read them (the fallbacks' numbers what they left)
    request, result = await fallbacks.fit(request, result)
    record = with_stable_head(CompactionRecord(
        prefix_len=len(turn.messages), prefix_hash=turn.prefix_hashes[-1],
        messages=result.compressed_messages, levels=[s.level.value for s in result.steps],
        tokens_before=turn.counter.count_messages(with_notice(view)),
        # With the notice its quoted notes bring (added when forwarded): what the provider counts.
        tokens_after=turn.counter.count_messages(with_notice(result.compressed_messages)), created_at=time.time(),
        counted_by=turn.counter.name, steps=covered_steps(numbered.conversation, result.compressed_messages)), turn)
    return CompactionPlan(record, result, collapse.to_dict(), breaker.to_dict(), working.to_dict(),
                          (time.perf_counter() - started) * 1000, _named(cuts, record.messages), depth,
                          folded or (0 if request.anchored else _merged(view, record.messages, cfg.pin_first_user,
                                                                        turn.dialect)),
                          as_is=not result.steps and reason == "proactive" and fits)


def _client_task(turn: Turn) -> str | None:
    """The fingerprint of the task statement as the client's own messages place it: read as the
    task and kept wherever the view puts it. In a view an earlier point made, a task kept beside a
    note can sit right before a reply that was never its own (aider's "Ok" to a command's output),
    and would read as context the client acknowledged (`conversation.client_task_index`)."""
    task = task_index(turn.messages)
    if task is None or turn.fingerprints.count(turn.fingerprints[task]) > 1:
        return None  # a task said again later ("continue") would pin every turn that says it
    return turn.fingerprints[task]


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
    # Their step ledgers fold into one range rather than go: every step number stays named, and
    # the range's reference gives their lines back (a larger fold was over the notes' cap again,
    # and the next point paid a summary to merge it).
    folded = request.messages[:start] + [merged(notes, request.counter, request.cuts.keep)] + request.messages[end:]
    return replace(request.with_messages(folded), anchored=True), len(notes)


def _summarised(view: list[dict[str, Any]], out: list[dict[str, Any]]) -> bool:
    """Whether `out` holds a summary note that `view` did not: the one this point paid for."""
    before = {orjson.dumps(m) for m in view if is_summary_note(m)}
    return any(is_summary_note(m) and orjson.dumps(m) not in before for m in out)


def _deferred(facts: SessionFacts, turn: Turn, view: list[dict[str, Any]], working: Any, started: float,
              depth: Depth) -> CompactionPlan:
    """A point that compacts nothing (no steps, `DEFERRED_HINT`): the request is forwarded as it is."""
    tokens = turn.counter.count_messages(with_notice(view))
    result = CompressionResult(compressed_messages=view, tokens_freed=0, level_used=None, tokens_after=tokens,
                               recovery_hints=[DEFERRED_HINT])
    record = with_stable_head(CompactionRecord(prefix_len=len(turn.messages), prefix_hash=turn.prefix_hashes[-1],
                                               messages=view, levels=[], tokens_before=tokens, tokens_after=tokens,
                                               created_at=time.time(), counted_by=turn.counter.name), turn)
    return CompactionPlan(record, result, facts.collapse, facts.breaker, working.to_dict(),
                          (time.perf_counter() - started) * 1000, {}, depth, as_is=True)


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
