"""The planner (pipeline/planner.py) on plain data: what a turn needs and what its compaction
point does, with no engine, no session store and no gateway; a session is a plain record of
its facts."""
from __future__ import annotations


from ctxgate.pipeline import planner
from ctxgate.pipeline.budget import Turn, effective_budget
from ctxgate.pipeline.config import CostConfig, PipelineConfig
from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.planner import Action
from ctxgate.pipeline.records import CompactionRecord
from ctxgate.pipeline.views import forwarded_view
from pipeline_builders import Facts, Message, counter, filler, system, tool_turn, user

LIMIT = 4000


async def _summarize(_: list[Message]) -> str:
    return "1. goal\n2. steps\n3. decisions\n4. open\n5. files\n6. tools"


def _turn(messages: list[Message], config: PipelineConfig | None = None) -> Turn:
    return Turn(messages=messages, fingerprints=[message_fingerprint(m) for m in messages], tools=None,
                counter=counter(), config=config or PipelineConfig(), max_input_tokens=LIMIT, summarize=_summarize)


def _history(share: float) -> list[Message]:
    """Tool turns of 200 tokens up to just over `share` of the effective budget."""
    budget = PipelineConfig().effective_budget(LIMIT)
    history = [system(), user("TASK: fix the failing test in src/app.py")]
    i = 0
    while counter().count_messages(history) <= share * budget:
        history += tool_turn(i, size=200)
        i += 1
    return history


def _decide(turn: Turn, facts: Facts, guard: bool = False, speculator: bool = False) -> planner.Decision:
    return planner.decide(turn, facts, forwarded_view(facts, turn)[1], guard, speculator)


def test_a_turn_under_the_trigger_is_forwarded_and_one_over_it_compacted() -> None:
    facts = Facts()
    assert _decide(_turn(_history(0.5)), facts) == planner.Decision(Action.FORWARD)
    over = _turn(_history(0.9))
    assert _decide(over, facts) == planner.Decision(Action.COMPACT, None)  # the cost model chooses the depth
    fixed = _turn(over.messages, PipelineConfig(cost=CostConfig(depth="target")))
    budget = effective_budget(fixed, None)
    assert _decide(fixed, facts) == planner.Decision(Action.COMPACT, fixed.target(budget, 0.5))


def test_over_the_watermark_a_background_compaction_is_asked_for_only_where_one_runs() -> None:
    turn = _turn(_history(0.8), PipelineConfig(cost=CostConfig(depth="target")))
    assert not _decide(turn, Facts()).speculate
    decision = _decide(turn, Facts(), speculator=True)
    assert decision.action is Action.FORWARD and decision.speculate
    assert decision.target is not None and decision.target < turn.target(effective_budget(turn, None), 0.5)


def test_the_request_compacted_last_is_forwarded_again_not_compacted_twice() -> None:
    turn = _turn(_history(0.9))
    record = CompactionRecord(prefix_len=len(turn.messages), prefix_hash=turn.prefix_hashes[-1],
                              messages=turn.messages, levels=["snip"], tokens_before=0, tokens_after=0, created_at=0.0)
    assert _decide(turn, Facts(records=[record])).action is Action.FORWARD


def test_the_loop_guard_gives_context_exhausted_or_the_degraded_mode() -> None:
    turn = _turn(_history(0.9))
    assert _decide(turn, Facts(), guard=True).action is Action.EXHAUSTED
    degrade = _turn(turn.messages, PipelineConfig(on_exhausted="degrade"))
    assert _decide(degrade, Facts(), guard=True).action is Action.DEGRADE
    assert planner.degraded(degrade).config.levels == ["autocompact"]


def test_a_request_whose_instructions_alone_are_over_the_limit_is_exhausted_before_any_call() -> None:
    turn = _turn([system(filler(LIMIT + 100)), user("TASK: anything")] + tool_turn(0, size=10))
    decision = _decide(turn, Facts())
    assert decision.action is Action.EXHAUSTED and "no compaction can make this request fit" in decision.why


def test_a_refusal_compacts_once_below_what_was_refused_then_degrades_or_gives_up() -> None:
    turn = _turn(_history(0.6), PipelineConfig(on_exhausted="degrade"))
    first = planner.after_refusal(turn, Facts(), 2500, guard=False, degraded=False, upstream_message="too long")
    assert first.action is Action.COMPACT and first.target is not None and first.target <= 2500 * 0.5
    assert planner.after_refusal(turn, Facts(), 2500, True, False, "too long").action is Action.DEGRADE
    last = planner.after_refusal(turn, Facts(), 2500, True, True, "too long: 2600 > 2000")
    assert last.action is Action.EXHAUSTED and "too long: 2600 > 2000" in last.why


def test_the_limit_an_upstream_names_is_learned_only_when_lower() -> None:
    assert planner.limit_in_error("This model's maximum context length is 3000 tokens", LIMIT) == 3000
    assert planner.limit_in_error("prompt is too long: 4100 tokens > 3500 maximum", LIMIT) == 3500
    assert planner.limit_in_error("prompt is too long: 9000 tokens > 5000 maximum", LIMIT) is None
    assert planner.limit_in_error("rate limited", LIMIT) is None


async def test_a_point_is_planned_on_plain_data_and_changes_none_of_it() -> None:
    """The record covers the client's whole list and lands under the budget; the session's
    stores come back as new values, the facts given stay as they were."""
    turn = _turn(_history(0.9))
    facts = Facts()
    point = await planner.plan(turn, facts, turn.messages, None, "proactive")
    assert not point.as_is and point.result.steps
    assert point.record.prefix_len == len(turn.messages) and point.record.prefix_hash == turn.prefix_hashes[-1]
    assert point.record.tokens_after < point.record.tokens_before
    assert point.record.tokens_after <= effective_budget(turn, None)
    assert point.breaker and facts == Facts()
