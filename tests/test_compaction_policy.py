"""How deep a compaction point goes (docs/compaction.md, the cost model), and what later
points leave of earlier ones: the cost model on its own, the compactor over a stateless
client's turns, and the settings that configure it."""
from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from ctxgate.pipeline.config import CostConfig, PipelineConfig
from ctxgate.pipeline.conversation import read_conversation
from ctxgate.pipeline.depth import NOTE_MARGIN, growth_per_turn, plan_depth, prices_of, summary_allowance
from ctxgate.pipeline.planner import DEFERRED_HINT
from ctxgate.pipeline.notes import (AUTOCOMPACT_MARKER, SNIP_MARKER, SUMMARY, context_note, is_compaction_note,
                                   is_restore_block)
from ctxgate.pipeline.refs import REF_RE
from ctxgate.pipeline.policy import CONSERVATIVE_PRICES, Outlook, Prices, choose_target, cost_per_turn
from ctxgate.proxy.engine.compaction import Compactor, fingerprints_of
from ctxgate.proxy.engine.state import SessionState
from ctxgate.proxy.engine.turn_budget import Turn
from pipeline_builders import Message, assistant, counter, filler, system, tool_turn, user

OPENAI = Prices(input=2.5, cache_read=1.25, cache_write=2.5, output=10.0)
ANTHROPIC = Prices(input=3.0, cache_read=0.3, cache_write=3.75, output=15.0)
BUDGET = 6000


def _outlook(**over: Any) -> Outlook:
    base = dict(trigger=5000, stable=1500, floor=2200, default=3000, growth=200.0, view=5200, summary_tokens=400)
    return Outlook(**{**base, **over})


@pytest.mark.parametrize("prices", [OPENAI, ANTHROPIC, CONSERVATIVE_PRICES])
def test_the_choice_is_the_cheapest_target_of_the_grid_and_within_the_floor_and_the_default(prices: Prices) -> None:
    outlook = _outlook()
    choice = choose_target(outlook, prices)
    assert outlook.floor <= choice.target <= outlook.default
    grid = [int(outlook.floor + (outlook.default - outlook.floor) * k / 16) for k in range(17)]
    assert choice.cost_per_turn == pytest.approx(min(cost_per_turn(t, outlook, prices) for t in grid))
    assert choice.turns == pytest.approx((outlook.trigger - choice.target) / outlook.growth)


def test_a_deeper_point_buys_more_turns_and_costs_less_per_turn_with_cache_writes_dear() -> None:
    """Anthropic charges 1.25x to write the cache: a point that lands lower amortises its
    write over more turns and reads less every turn."""
    outlook = _outlook()
    shallow, deep = cost_per_turn(outlook.default, outlook, ANTHROPIC), cost_per_turn(outlook.floor, outlook, ANTHROPIC)
    assert deep < shallow
    assert choose_target(outlook, ANTHROPIC).target == outlook.floor


def test_a_floor_above_the_default_is_the_target() -> None:
    outlook = _outlook(floor=3500, default=3000)
    assert choose_target(outlook, ANTHROPIC).target == 3500


def test_a_point_that_buys_no_turn_counts_as_one() -> None:
    outlook = _outlook(floor=4990, default=4990)
    assert choose_target(outlook, OPENAI).turns == 1.0


def test_prices_come_from_the_profile_then_the_route_then_the_conservative_default() -> None:
    configured = PipelineConfig(cost={"prices": {"input": 1, "cache_read": 0.5, "cache_write": 1}})
    assert prices_of(configured, ANTHROPIC).cache_read == 0.5
    assert prices_of(PipelineConfig(), ANTHROPIC) is ANTHROPIC
    assert prices_of(PipelineConfig(), None) is CONSERVATIVE_PRICES


@pytest.mark.parametrize("bad", [{"input": -1, "cache_read": 0, "cache_write": 0},
                                 {"input": "cheap", "cache_read": 0, "cache_write": 0},
                                 {"input": float("nan"), "cache_read": 0, "cache_write": 0}])
def test_a_price_that_is_negative_or_not_a_number_is_refused_with_its_path(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as e:
        PipelineConfig(cost={"prices": bad})
    assert ("cost", "prices", "input") in [err["loc"] for err in e.value.errors()]


def test_min_turns_below_one_is_refused() -> None:
    with pytest.raises(ValidationError):
        PipelineConfig(cost={"min_turns": 0})


# ---------------------------------------------------------------------------------------
# The compactor over a stateless client's turns


def _turn(messages: list[Message], summarize: Any, config: PipelineConfig | None = None) -> Turn:
    return Turn(messages=messages, fingerprints=fingerprints_of(messages), tools=None, counter=counter(),
                config=config or PipelineConfig(), max_input_tokens=BUDGET, summarize=summarize)


class Summaries:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, _: list[Message]) -> str:
        self.calls += 1
        return (f"1. goal: fix the test (summary {self.calls})\n2. steps\n3. decisions\n4. open\n5. files\n"
                "6. tools")


MERGES: list[int] = []


async def _replay(turns: int, size: int, config: PipelineConfig | None = None
                  ) -> tuple[list[list[Message]], list[int], Summaries]:
    """`turns` agent turns of `size`-token outputs, each forwarded as a stateless client
    would send it; the forwarded requests, the turns that were compaction points, the summaries.
    Each merge of earlier notes is appended to MERGES (the compactor's `on_merge`)."""
    history = [system(), user("TASK: fix the failing test in src/app.py")]
    MERGES.clear()
    compactor = Compactor(on_merge=lambda: MERGES.append(1))
    state, summaries = SessionState("t", "s"), Summaries()
    sent: list[list[Message]] = []
    points: list[int] = []
    for i in range(turns):
        history = history + tool_turn(i, size=size)
        newest = state.records[-1] if state.records else None
        plan = await compactor.prepare(state, _turn(history, summaries, config))
        state.has_attempted_reactive_compact = False  # the upstream answered
        if state.records and state.records[-1] is not newest:  # the list is capped: its length may not change
            points.append(i)
        sent.append(plan.messages)
    return sent, points, summaries


async def test_a_later_point_leaves_the_earlier_notes_byte_identical_and_adds_its_own_after_them() -> None:
    sent, points, _ = await _replay(60, 120)
    assert len(points) >= 2, "the run must reach two compaction points"
    first, second = sent[points[0]], sent[points[1]]
    notes = [m for m in first if is_compaction_note(m)]
    assert notes, "the first point left a note"
    end = first.index(notes[-1]) + 1
    assert second[:end] == first[:end], "the prefix up to the first point's last note is what the provider cached"
    assert len([m for m in second if is_compaction_note(m)]) > len(notes)
    restore = [i for i, m in enumerate(second) if is_restore_block(m)]
    last_note = max(i for i, m in enumerate(second) if is_compaction_note(m))
    assert all(i > last_note for i in restore), "the restore blocks come after every note"


async def test_each_point_asks_for_at_most_one_summary_and_between_points_the_prefix_holds() -> None:
    sent, points, summaries = await _replay(60, 120)
    assert summaries.calls <= len(points)
    for i in range(1, len(sent)):
        if i not in points:
            assert sent[i][:len(sent[i - 1])] == sent[i - 1], f"turn {i} is no compaction point but changed the prefix"


async def test_the_cost_model_compacts_more_rarely_than_the_fixed_target() -> None:
    _, fixed, fixed_summaries = await _replay(100, 120, PipelineConfig(cost={"depth": "target"}))
    _, cost, cost_summaries = await _replay(100, 120)
    assert len(cost) < len(fixed)
    assert cost_summaries.calls <= fixed_summaries.calls


async def test_notes_past_their_cap_are_merged_by_the_next_point() -> None:
    """A cap of 1% of the room: every point finds the earlier notes over it and merges them,
    so there is never more than one summary note."""
    sent, points, _ = await _replay(60, 120, PipelineConfig(notes_cap_ratio=0.01))
    assert len(points) >= 2
    for request in sent:
        assert sum(1 for m in request if is_compaction_note(m) and AUTOCOMPACT_MARKER in m["content"]) <= 1
    assert MERGES and len(MERGES) <= len(points) - 1, "the points after the first merged the notes, counted"
    await _replay(60, 120)
    assert not MERGES, "under the default cap, no point merges"


def test_the_recent_window_narrows_when_keeping_it_whole_buys_too_few_turns() -> None:
    """Large outputs in the recent window and a small budget: keeping the newest 10 messages
    verbatim would leave room for fewer than `min_turns` turns; the point keeps the newest
    complete steps instead."""
    history = [system(), user("TASK: fix the failing test in src/app.py")]
    for i in range(8):
        history += tool_turn(i, size=120)
    for i in range(8, 12):
        history += tool_turn(i, size=600)
    turn = _turn(history, Summaries())
    budget = PipelineConfig().effective_budget(BUDGET)
    depth = plan_depth(turn, history, budget, restore=0)
    assert depth.window != PipelineConfig().window()
    assert depth.window.steps >= 1
    assert growth_per_turn(turn) > 0
    wide = plan_depth(turn, history, 10 * budget, restore=0)
    assert wide.window == PipelineConfig().window(), "with room to spare the whole window is kept"


# ---------------------------------------------------------------------------------------
# Prices per route


def test_a_route_without_known_prices_uses_the_conservative_ones_and_says_so_once(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    from ctxgate.proxy.config import load_config
    from ctxgate.proxy.upstream.routing import Router

    unknown = {"model": "openai/a-private-model-ctxgate-test", "api_base": "http://127.0.0.1:9/v1"}
    known = {"model": "openai/gpt-4o", "api_base": "http://127.0.0.1:9/v1"}
    path = tmp_path / "ctxgate.yaml"
    path.write_text(yaml.safe_dump({"model_list": [{"model_name": "private", "litellm_params": unknown},
                                                   {"model_name": "private", "litellm_params": unknown},
                                                   {"model_name": "gpt-4o", "litellm_params": known}]}))
    with caplog.at_level("INFO", logger="ctxgate.routing"):
        router = Router(load_config(path))
    said = [r.getMessage() for r in caplog.records if "no prices known" in r.getMessage()]
    assert len(said) == 1 and "a-private-model-ctxgate-test" in said[0]
    assert router.resolve("private").prices is None
    assert prices_of(PipelineConfig(), router.resolve("private").prices) is CONSERVATIVE_PRICES
    gpt = router.resolve("gpt-4o").prices
    assert gpt is not None and 0 < gpt.cache_read < gpt.input  # from litellm's cost map


def test_a_point_frees_at_least_clear_at_least() -> None:
    """Instructions that take most of the budget (Claude Code's 29K of a 60K limit) leave the
    point a target just under the request: it goes deeper, freeing at least
    `cost.clear_at_least` (a tenth of the budget by default), so a cache break buys room."""
    history = [system("You are a careful coding agent. " * 400), user("TASK: fix the failing test in src/app.py")]
    for i in range(12):
        history += tool_turn(i, size=150)
    view = _turn(history, Summaries()).message_tokens()
    budget = int(view / 0.86)  # just over the trigger
    targets = []
    for least in (0, None, view // 4):
        config = PipelineConfig(cost=CostConfig(clear_at_least=least))
        depth = plan_depth(_turn(history, Summaries(), config), history, budget, restore=0)
        assert depth.target <= view - config.cost.least_gain(budget), (least, depth.target, view)
        targets.append(depth.target)
    assert targets[0] >= targets[1] > targets[2], targets  # the larger the least gain, the deeper the point
    with pytest.raises(ValidationError):
        CostConfig(clear_at_least=-1)


async def test_instructions_that_take_nearly_all_the_room_leave_no_turn_over_the_budget() -> None:
    """A system prompt that leaves 200 tokens of the budget: the notes a compaction point adds
    do not fit beside the newest step, and they go (the restored state first, then the notes)
    rather than forward a request the provider refuses."""
    budget = PipelineConfig().effective_budget(BUDGET)
    history = [system(filler(budget - 200, 99)), user("TASK: fix the failing test in src/app.py")]
    compactor, state, summaries = Compactor(), SessionState("t", "s"), Summaries()
    over = []
    for i in range(20):
        history = history + tool_turn(i, size=60)
        plan = await compactor.prepare(state, _turn(history, summaries))
        state.has_attempted_reactive_compact = False  # the upstream answered
        if counter().count_messages(plan.messages) > budget:
            over.append((i, counter().count_messages(plan.messages)))
        assert plan.messages[:2] == history[:2] and plan.messages[-1] == history[-1]
    assert state.records, "the run reached compaction points"
    assert over == [], f"turns forwarded over the effective budget of {budget}: {over}"


async def test_short_chat_turns_under_a_large_prompt_are_dropped_rather_than_forwarded_over_the_limit() -> None:
    """A customer-service chat: a system prompt that leaves a few turns of room, turns too
    small and too few for Snip's minimums (blocks of 5 in 10 messages) and no output for
    Microcompact to cut. The oldest turns after the task go, under a note that counts them,
    rather than a request the provider refuses."""
    history = [system(filler(BUDGET - 150, 7)), user("TASK: change my flight to Friday")]
    compactor, state, summaries = Compactor(), SessionState("t", "s"), Summaries()
    over, dropped = [], 0
    for i in range(12):
        history = history + [assistant(filler(30, 100 + i)), user(filler(20, 200 + i))]
        plan = await compactor.prepare(state, _turn(history, summaries))
        state.has_attempted_reactive_compact = False  # the upstream answered
        sent = counter().count_messages(plan.messages)
        if sent > BUDGET:
            over.append((i, sent))
        assert plan.messages[:2] == history[:2] and plan.messages[-1] == history[-1]
        dropped = max(dropped, len(history) - len(plan.messages))
    assert dropped > 0, "the run never had to drop a turn"
    assert over == [], f"turns forwarded over the context limit of {BUDGET}: {over}"


async def test_a_window_that_leaves_no_room_is_cut_once_deeply_not_shaved_every_turn() -> None:
    """Instructions that take half the budget (Claude Code's 29K of system prompt and
    tools under a 60K limit) and large outputs: the configured window of 10 messages alone
    fills the room the profile's target leaves. A point keeps the newest step and cuts the
    older window at once with the cheap levels, freeing at least the least gain: points do
    not come at every turn, and the cheap levels free most of them with no summary
    (measured before this change: 18 points and 17 summary calls in the 40 turns; after:
    14 points and 4 calls)."""
    budget = PipelineConfig().effective_budget(BUDGET)
    history = [system(filler(int(budget * 0.5), 7)), user("TASK: fix the failing test in src/app.py")]
    compactor, state, summaries = Compactor(), SessionState("t", "s"), Summaries()
    turns = 40
    for i in range(turns):
        history = history + tool_turn(i, size=400)
        await compactor.prepare(state, _turn(history, summaries))
        state.has_attempted_reactive_compact = False  # the upstream answered
    freed = [e["tokens_before"] - e["tokens_after"] for e in state.compaction_log if e["level"] == "chain"]
    assert freed, "the run reached compaction points"
    assert len(freed) <= turns // 2, f"{len(freed)} points in {turns} turns"
    least = PipelineConfig().cost.least_gain(budget)
    assert all(f >= least for f in freed), (least, freed)
    assert summaries.calls <= len(freed) // 2, f"{summaries.calls} summary calls for {len(freed)} points"


def test_the_summary_allowance_is_what_the_session_summariser_wrote_once_one_is_seen() -> None:
    """Before any summary, the floor reserves Autocompact's allowance; once the session has a
    summary note, its size and a quarter (never over the allowance, never under 100)."""
    cfg, budget = PipelineConfig(), PipelineConfig().effective_budget(BUDGET)
    configured = min(cfg.autocompact.summary_max_tokens, budget // 8)
    base = [system(), user("TASK: fix the failing test in src/app.py")] + tool_turn(1, size=200)
    fresh = read_conversation(base)
    assert summary_allowance(cfg, budget, fresh, fresh.counts(counter())) == configured
    note = context_note(SUMMARY, "compaction summary", f"{AUTOCOMPACT_MARKER}\n" + filler(300, 3))
    seen = read_conversation(base[:2] + [note] + base[2:])
    counts = seen.counts(counter())
    assert summary_allowance(cfg, budget, seen, counts) == int((counts[2] - NOTE_MARGIN) * 1.25) < configured
    long_note = context_note(SUMMARY, "compaction summary", f"{AUTOCOMPACT_MARKER}\n" + filler(2000, 4))
    long = read_conversation(base[:2] + [long_note] + base[2:])
    assert summary_allowance(cfg, budget, long, long.counts(counter())) == configured


async def test_a_turn_over_the_trigger_whose_cut_frees_too_little_is_forwarded_as_it_is() -> None:
    """Instructions at 60% of the budget and 200-token outputs: at the trigger, what lies
    older than the newest step is often less than the least gain. Such a turn is no
    compaction point while it fits the budget: the client's request goes out as it is, the
    cached prefix intact, and the cut comes once it frees the least gain (before, each of
    these turns was a point that shaved a few tokens off the window)."""
    budget = PipelineConfig().effective_budget(BUDGET)
    least = PipelineConfig().cost.least_gain(budget)
    history = [system(filler(int(budget * 0.6), 7)), user("TASK: fix the failing test in src/app.py")]
    compactor, state, summaries = Compactor(), SessionState("t", "s"), Summaries()
    deferred, previous = 0, None
    for i in range(40):
        history = history + tool_turn(i, size=200)
        points = len([e for e in state.compaction_log if e["level"] == "chain"])
        plan = await compactor.prepare(state, _turn(history, summaries))
        state.has_attempted_reactive_compact = False
        if len([e for e in state.compaction_log if e["level"] == "chain"]) == points:
            if DEFERRED_HINT in plan.hints:
                assert (plan.tokens_out or 0) > PipelineConfig().trigger_ratio * budget, "deferred under the trigger"
                deferred += 1
            if previous is not None:
                assert plan.messages[:len(previous)] == previous, f"turn {i}: no point, yet the prefix changed"
        previous = plan.messages
    freed = [e["tokens_before"] - e["tokens_after"] for e in state.compaction_log if e["level"] == "chain"]
    assert deferred, "some turn over the trigger was forwarded as it was"
    assert freed and all(f >= least for f in freed), (least, freed)


async def test_notes_without_a_summary_among_them_are_merged_into_one_note_with_no_summary_call() -> None:
    """Snip's notes over their cap (1% of the room) and no summary among them: the next point
    folds them into one note that names their text, which the content store gives back, and
    asks for no summary to do it (before, Autocompact merged them: a summary call); the merge
    is counted like any other."""
    config = PipelineConfig(notes_cap_ratio=0.01)
    merges: list[int] = []
    compactor, state = Compactor(on_merge=lambda: merges.append(1)), SessionState("t", "s")
    summaries = Summaries()
    history = [system(), user("TASK: fix the failing test in src/app.py")]
    folded: list[Message] = []
    for i in range(60):
        history = history + tool_turn(i, size=120)
        plan = await compactor.prepare(state, _turn(history, summaries, config))
        state.has_attempted_reactive_compact = False
        folded += [m for m in plan.messages if "merged to fit the context budget" in str(m.get("content"))]
    assert folded and merges, "the notes went over their cap and were merged"
    assert summaries.calls == 0, "a merge of Snip's notes asked for a summary"
    ref = REF_RE.search(folded[0]["content"])
    assert ref is not None
    original = await compactor.content.get("t", "s", ref.group(1), 3600)
    assert original is not None and SNIP_MARKER in original, "the folded notes can be expanded"
