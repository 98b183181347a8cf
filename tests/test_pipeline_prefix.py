"""The compactor over a stateless client's turns: the forwarded prefix stays byte-identical
from one request to the next except at a compaction point."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.fingerprint import prefix_hashes
from ctxgate.pipeline.notes import has_quoted, with_notice
from ctxgate.proxy.engine.compaction import Compactor, fingerprints_of
from ctxgate.proxy.engine.turn_budget import Turn
from ctxgate.proxy.engine.state import CompactionRecord, SessionState
from pipeline_builders import Message, assistant, counter, filler, system, tool_turn, user

BUDGET = 4000


async def _never(_: list[Message]) -> str:
    raise AssertionError("no summary should be needed")


def _turn(messages: list[Message], summarize: Any = _never) -> Turn:
    return Turn(messages=messages, fingerprints=fingerprints_of(messages), tools=None, counter=counter(),
                config=PipelineConfig(), max_input_tokens=BUDGET, summarize=summarize)


def _near_trigger() -> list[Message]:
    """A history just below the trigger, so any new output of some size crosses it."""
    trigger = 0.85 * PipelineConfig().effective_budget(BUDGET)
    history = [system(), user("TASK: fix the failing test in src/app.py")]
    i = 0
    for size in (200, 10):
        while counter().count_messages(history + tool_turn(i, size=size)) < trigger:
            history += tool_turn(i, size=size)
            i += 1
    return history


async def _summary(_: list[Message]) -> str:
    return "1. goal\n2. steps\n3. decisions\n4. open\n5. files\n6. tools"


async def _forward(compactor: Compactor, state: SessionState, messages: list[Message],
                   summarize: Any = _never) -> list[Message]:
    plan = await compactor.prepare(state, _turn(messages, summarize))
    state.has_attempted_reactive_compact = False  # the upstream answered
    return plan.messages


async def test_a_long_output_arriving_is_forwarded_whole_in_the_recent_window() -> None:
    """The newest messages reach the upstream as the client sent them, however long: the
    compaction the output sets off works on what is older, and the next turn starts with
    what this one forwarded."""
    history = [system(), user("TASK: fix the failing test in src/app.py")]
    for i in range(10):
        history += tool_turn(i, size=250)
    compactor, state = Compactor(), SessionState("t", "s")
    before = await _forward(compactor, state, history)
    assert before == history  # below the trigger: transparent

    grown = history + tool_turn(12, size=600)
    after = await _forward(compactor, state, grown, _summary)
    assert state.records, "the output took the session over the trigger"
    # With this little room the point keeps the newest complete steps rather than all ten
    # messages (docs/compaction.md, the recent window adapts to the room).
    assert after[-4:] == grown[-4:]
    assert "tokens truncated" not in after[-1]["content"]
    assert counter().count_messages(after) <= PipelineConfig().effective_budget(BUDGET)

    nxt = grown + tool_turn(13, size=20)
    again = await _forward(compactor, state, nxt)
    assert again[:len(after)] == after  # the record reproduces the compaction next turn
    assert again[-6:] == nxt[-6:]


async def test_an_observation_forwarded_whole_as_the_newest_message_stays_whole() -> None:
    """SWE-agent style: tool output comes back in a user message, forwarded untouched while
    it is the newest; in a compacted session it must not be cut on the next turn (the
    upstream saw it whole: cutting it then would break the prefix outside a compaction)."""
    history = [system(), user("TASK: fix the failing test in src/app.py")]
    for i in range(6):
        history += tool_turn(i, size=150)
    compactor, state = Compactor(), SessionState("t", "s")
    await _forward(compactor, state, history)
    history += tool_turn(6, size=3000)
    await _forward(compactor, state, history)
    assert state.records  # the long output took the session over the trigger: it is compacted

    history += [assistant("Let me look at the file."), user(filler(1500, 77))]
    before = await _forward(compactor, state, history)
    assert before[-1] == history[-1]  # the newest user message is never compressed
    history += [assistant("Now I run the tests."), user("OBSERVATION: 3 passed")]
    after = await _forward(compactor, state, history)
    assert after[:len(before)] == before


async def test_a_history_over_the_trigger_is_compacted_by_the_chain() -> None:
    history = _near_trigger()
    summaries = 0

    async def summarize(_: list[Message]) -> str:
        nonlocal summaries
        summaries += 1
        return "1. goal\n2. steps\n3. decisions\n4. open\n5. files\n6. tools"

    compactor, state = Compactor(), SessionState("t", "s")
    grown = history + tool_turn(99, size=3000)
    plan = await compactor.prepare(state, _turn(grown, summarize))
    assert plan.levels and summaries <= 1, "Snip, or a summary, takes the oldest outputs away"
    assert filler(200, 0) not in str(plan.messages)
    assert plan.messages[-1] == grown[-1], "the last message is never changed"


async def test_the_point_that_brings_the_first_quoted_note_rewrites_only_what_it_changes() -> None:
    """The notice ctxgate's quoted notes bring stands right before the first of them, so the
    point that brings it leaves what it kept before its notes (the system prompt and the task)
    as the provider cached it: placed after the system prompt, the notice rewrote the task at
    every such point (measured on the per-dialect bench, bench/RESULTS.md issue34-cache)."""
    compactor, state = Compactor(), SessionState("t", "s")
    history = _near_trigger()
    before = with_notice(await _forward(compactor, state, history))  # as the gateway forwards it
    assert before == history, "below the trigger: transparent"
    grown = history + tool_turn(99, size=600)
    planned = await _forward(compactor, state, grown, _summary)
    after = with_notice(planned)
    assert state.records and has_quoted(after), "a point with a quoted note"
    kept = next(i for i, (a, b) in enumerate(zip(planned, grown)) if a != b)
    assert kept >= 2 and after[:kept] == before[:kept], "the system prompt and the task stay as they were sent"


def _speculation(history: list[Message], k: int, replacement: list[Message]) -> dict[str, Any]:
    """A background compaction of history[:k], as the speculator leaves it in the session."""
    record = CompactionRecord(prefix_len=k, prefix_hash=prefix_hashes(fingerprints_of(history[:k]))[-1],
                              messages=replacement, levels=["autocompact"], tokens_before=0, tokens_after=0,
                              created_at=0.0)
    return {"record": asdict(record), "collapse": {}, "breaker": {}, "working": {}}


async def test_a_speculation_that_no_longer_leaves_room_is_kept_and_compacted_on() -> None:
    """Its span is still the client's history: it is applied (what it paid for is not thrown
    away, tests/test_summary_waste.py) and what came since is compacted on top of it."""
    history = _near_trigger()
    grown = history + tool_turn(99, size=60)  # over the trigger
    state = SessionState("t", "s")
    state.speculative = _speculation(grown, 6, grown[:6])  # made long ago: it saves nothing now
    summaries = 0

    async def summarize(_: list[Message]) -> str:
        nonlocal summaries
        summaries += 1
        return "1. goal\n2. steps\n3. decisions\n4. open\n5. files\n6. tools"

    plan = await Compactor().prepare(state, _turn(grown, summarize))
    assert state.speculation_wasted == 1 and not state.speculative
    assert [e["level"] for e in state.compaction_log][:1] == ["speculative"], "applied first"
    assert plan.levels and not any("speculative" in h for h in plan.hints), "then compacted on top"
    assert counter().count_messages(plan.messages) < counter().count_messages(grown)


async def test_a_speculation_that_still_leaves_room_is_adopted() -> None:
    history = _near_trigger()
    grown = history + tool_turn(99, size=60)
    k = len(history) - 4
    state = SessionState("t", "s")
    state.speculative = _speculation(grown, k, grown[:2] + [{"role": "system", "content": "summary"}])
    plan = await Compactor().prepare(state, _turn(grown))
    assert any("speculative" in h for h in plan.hints) and state.speculation_wasted == 0
    assert plan.messages[:3] == grown[:2] + [{"role": "system", "content": "summary"}]
    assert len(plan.messages) == 3 + len(grown) - k  # the rest as sent


async def test_an_expansion_exchange_is_put_back_until_a_compaction_takes_it_in() -> None:
    """What the gateway's expansion tool added after a client's message comes back in place on
    later turns, counted; a compaction then covers it and it leaves the list."""
    history = [system(), user("TASK: fix the failing test in src/app.py")]
    for i in range(6):
        history += tool_turn(i, size=60)
    k = len(history)
    exchange = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_expand_1", "type": "function", "function": {"name": "ctxgate_expand", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_expand_1", "content": filler(300, 5)}]
    state = SessionState("t", "s")
    state.add_expanded(k, prefix_hashes(fingerprints_of(history))[-1], exchange)
    compactor = Compactor()
    grown = history + [assistant("done"), user("next")]
    plan = await compactor.prepare(state, _turn(grown))
    assert plan.messages == history + exchange + grown[k:]
    assert plan.tokens_out == counter().count_messages(plan.messages)
    edited = [*history[:-1], {**history[-1], "content": "another output"}, *grown[k:]]
    assert (await compactor.prepare(SessionState("t", "s2", expanded=state.expanded), _turn(edited))).messages == edited
    while not state.records:  # grow until a compaction takes the exchange in
        grown += tool_turn(len(grown), size=200)
        plan = await compactor.prepare(state, _turn(grown, _summary))
        state.has_attempted_reactive_compact = False
    assert state.expanded == []
