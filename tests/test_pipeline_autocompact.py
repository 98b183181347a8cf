"""Level 4, Autocompact, with a scripted summariser instead of an LLM."""
from __future__ import annotations

import asyncio
import time

import pytest

from ctxgate.pipeline.autocompact import (DEGRADE_KEEP, SUMMARY_PROMPT, AutocompactBreaker, AutocompactStrategy,
                                          serialise, shorten)
from ctxgate.pipeline.config import AutocompactConfig
from ctxgate.pipeline.notes import AUTOCOMPACT_MARKER, quoted_text
from ctxgate.pipeline.conversation import read_conversation, shape_of, split_units
from ctxgate.pipeline.ledger import ledger_room
from ctxgate.pipeline.request import CompressionRequest
from ctxgate.pipeline.types import Level

from pipeline_builders import (LAST_UNIT, agent_history, assert_invariants, assistant, counter, filler, real_histories,
                               snapshot, system, tool_turn, user)

SIX_FIELDS = ("core goal", "steps completed", "Key decision points", "Unresolved problems and pending tasks",
              "files currently being worked on", "skill or tool context")


class Scripted:
    """An async summarise function that records every prompt it is sent."""

    def __init__(self, reply: str = "- goal: fix the test\n- done: ran pytest", delay: float = 0.0,
                 error: Exception | None = None) -> None:
        self.reply, self.delay, self.error = reply, delay, error
        self.calls: list[list[dict]] = []

    async def __call__(self, prompt: list[dict]) -> str:
        self.calls.append(prompt)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return self.reply


def make(summarize=None, breaker=None, precomputed=None, **cfg) -> AutocompactStrategy:
    return AutocompactStrategy(AutocompactConfig(**cfg), summarize, breaker, True, precomputed)


async def run(s: AutocompactStrategy, messages, budget: int, reason="proactive"):
    return await s.compress(CompressionRequest(messages, budget, counter(), reason, window=LAST_UNIT))


async def test_summary_replaces_the_old_history() -> None:
    h = agent_history(40, 200)
    before = snapshot(h)
    fake = Scripted()
    s = make(fake)
    budget = 4000
    result = await run(s, h, budget)
    assert h == before, "the caller's list was mutated"
    assert result.level_used is Level.AUTOCOMPACT and result.fits
    assert result.tokens_after <= budget
    assert len(fake.calls) == 1
    prompt = fake.calls[0]
    assert prompt[0] == {"role": "system", "content": SUMMARY_PROMPT}
    for field in SIX_FIELDS:
        assert field in prompt[0]["content"]
    assert [line[:2] for line in SUMMARY_PROMPT.split("\n")[1:7]] == ["1.", "2.", "3.", "4.", "5.", "6."]
    plan = s.plan(CompressionRequest(h, budget, counter(), window=LAST_UNIT))
    assert prompt[1] == {"role": "user", "content": "Conversation history:\n\n" + serialise(h[2:plan.end], counter())}
    assert "[assistant] [called execute_bash(" in prompt[1]["content"]
    assert "[tool] line0x0 line0x1" in prompt[1]["content"]
    out = result.compressed_messages
    assert out[:2] == h[:2]
    recovery = out[2]
    assert recovery["role"] == "user" and quoted_text(recovery).startswith(AUTOCOMPACT_MARKER)
    assert fake.reply in recovery["content"]
    assert "Recovery instructions" in recovery["content"] and "Continue the unfinished task" in recovery["content"]
    assert out[3:] == h[plan.end:]
    assert result.steps[0].span == (2, plan.end)
    assert_invariants(h, out)
    assert s.breaker.failures == 0


async def test_tail_to_head_scan_keeps_the_newest_units_that_fit() -> None:
    h = agent_history(40, 200)
    c = counter()
    s = make(Scripted())
    for budget in (1500, 2500, 4000, 7000):
        plan = s.plan(CompressionRequest(h, budget, c, window=LAST_UNIT))
        shape = shape_of(h, window=LAST_UNIT)
        room = budget - (c.count_messages(h[:shape.head]) + s.summary_tokens(budget) + 80
                         + ledger_room(read_conversation(h), shape.head, shape.tail, budget, c)
                         + sum(c.count_structured(h[i]) for i in shape.pinned))
        kept = sum(c.count_structured(m) for i, m in enumerate(h) if i >= plan.end and i not in shape.pinned)
        starts = [u.start for u in split_units(h)]
        assert plan.end in starts
        assert kept <= room or plan.end == shape.tail, budget
        older = max(u for u in starts if u < plan.end)
        if older >= shape.head:
            cost = sum(c.count_structured(h[i]) for i in range(older, plan.end) if i not in shape.pinned)
            assert kept + cost > room, f"budget {budget}: one more unit would have fit"
        result = await run(s, h, budget)
        assert result.fits, budget
        kept_n = len(h) - plan.end
        assert any(hint.endswith(f"kept the last {kept_n}") for hint in result.recovery_hints)


async def test_nothing_older_to_summarise() -> None:
    h = [system(), user("task"), *tool_turn(0, size=3000)]
    fake = Scripted()
    assert await run(make(fake), h, 100) is None
    assert fake.calls == []


async def test_no_summary_is_asked_for_a_span_its_note_would_outweigh() -> None:
    """A span of a few short messages: the recovery note alone is as long, so nothing would be
    saved and the summary would be thrown away; it is never asked for."""
    h = [system(), user("task"), assistant("ok"), user("go on"), *tool_turn(0, size=20)]
    fake = Scripted()
    assert await run(make(fake), h, 10) is None
    assert fake.calls == []


async def test_long_summary_is_cut_to_its_allowance() -> None:
    h = agent_history(40, 200)
    long = filler(3000, 77)
    s = make(Scripted(reply=long))
    result = await run(s, h, 4100)  # room beside the kept messages and the note's quote for the whole allowance
    allowance = s.summary_tokens(4100)
    assert allowance == 512
    assert counter().head(long, allowance) in result.compressed_messages[2]["content"]
    assert long not in result.compressed_messages[2]["content"]
    assert result.fits


async def test_timeout_counts_as_failure() -> None:
    h = agent_history(40, 200)
    fake = Scripted(delay=2.0)
    s = make(fake, timeout_s=0.05)
    started = time.perf_counter()
    result = await run(s, h, 4000)
    assert time.perf_counter() - started < 1.0
    assert len(fake.calls) == 1
    assert result.compressed_messages is h and result.steps == [] and not result.fits
    assert s.breaker.failures == 1 and s.breaker.last_error == "timed out"
    assert any("summary failed (timed out)" in hint for hint in result.recovery_hints)


async def test_exceptions_count_and_three_in_a_row_open_the_breaker() -> None:
    h = agent_history(40, 200)
    fake = Scripted(error=RuntimeError("upstream 500"))
    s = make(fake)
    for n in (1, 2, 3):
        result = await run(s, h, 4000)
        assert result.steps == [] and result.compressed_messages is h
        assert s.breaker.failures == n
        assert any("RuntimeError: upstream 500" in hint for hint in result.recovery_hints)
    assert s.breaker.open and len(fake.calls) == 3
    for _ in range(2):
        result = await run(s, h, 4000)
        assert len(fake.calls) == 3, "no further call once the breaker is open"
        assert any("off for this session after 3 failures in a row" in hint for hint in result.recovery_hints)
        assert result.steps == [] and not result.fits
    # the breaker survives the session store
    again = AutocompactBreaker.from_dict(s.breaker.to_dict())
    assert again.open and again.failures == 3 and "upstream 500" in again.last_error


async def test_mixed_failures_and_a_success_resets() -> None:
    h = agent_history(40, 200)
    breaker = AutocompactBreaker(max_failures=3)
    await run(make(Scripted(delay=1.0), breaker, timeout_s=0.02), h, 4000)
    await run(make(Scripted(error=ValueError("bad")), breaker), h, 4000)
    assert breaker.failures == 2 and not breaker.open
    ok = await run(make(Scripted(), breaker), h, 4000)
    assert ok.steps and breaker.failures == 0 and breaker.last_error == ""
    for _ in range(3):
        await run(make(Scripted(error=OSError("x")), breaker), h, 4000)
    assert breaker.open
    fake = Scripted()
    await run(make(fake, breaker), h, 4000)
    assert fake.calls == []


async def test_precomputed_summary_is_used_without_a_call() -> None:
    h = agent_history(40, 200)
    fake = Scripted(error=AssertionError("must not be called"))
    probe = make(fake)
    plan = probe.plan(CompressionRequest(h, 4000, counter(), window=LAST_UNIT))
    pre = {plan.key: {"summary": "PRECOMPUTED SUMMARY", "length": plan.length}}
    s = make(fake, precomputed=pre)
    result = await run(s, h, 4000)
    assert fake.calls == []
    assert "PRECOMPUTED SUMMARY" in result.compressed_messages[2]["content"]
    assert result.fits and s.breaker.failures == 0
    # even with the breaker open: it costs no call
    open_breaker = AutocompactBreaker(failures=3, max_failures=3)
    assert (await run(make(fake, open_breaker, pre), h, 4000)).steps
    # a key for another span is not used
    other = make(Scripted(reply="fresh"), precomputed={"0" * 32: {"summary": "stale", "length": 1}})
    assert "fresh" in (await run(other, h, 4000)).compressed_messages[2]["content"]


async def test_plan_key_depends_only_on_the_span() -> None:
    h = agent_history(40, 200)
    s = make(Scripted())
    p1, p2 = (s.plan(CompressionRequest(h, 4000, counter(), window=LAST_UNIT)),
              s.plan(CompressionRequest(snapshot(h), 4000, counter(), window=LAST_UNIT)))
    assert p1 == p2
    changed = snapshot(h)
    changed[3] = {**changed[3], "content": "different"}
    assert s.plan(CompressionRequest(changed, 4000, counter(), window=LAST_UNIT)).key != p1.key


async def test_degrade_keeps_only_the_last_three() -> None:
    h = agent_history(40, 200)
    fake = Scripted()
    result = await run(make(fake), h, 100_000, reason="degrade")
    out = result.compressed_messages
    assert len(fake.calls) == 1
    assert out[:2] == h[:2] and quoted_text(out[2]).startswith(AUTOCOMPACT_MARKER)
    assert out[3:] == h[-DEGRADE_KEEP:] and len(out) == 2 + 1 + DEGRADE_KEEP
    # the newest user message is older than the last three: it stays, pinned, after the recovery message
    h2 = [system(), user("task"), user("NEWEST")] + [m for i in range(10) for m in tool_turn(i)] \
        + [assistant("a"), assistant("b"), assistant("c")]
    out2 = (await run(make(Scripted()), h2, 100_000, reason="degrade")).compressed_messages
    assert out2[:2] == h2[:2] and quoted_text(out2[2]).startswith(AUTOCOMPACT_MARKER)
    assert out2[3] == user("NEWEST") and out2[4:] == h2[-3:]
    assert_invariants(h2, out2)


async def test_degrade_never_splits_a_unit() -> None:
    h = agent_history(10, 50) + [user("more"), assistant("a")] + tool_turn(99)
    out = (await run(make(Scripted()), h, 100_000, reason="degrade")).compressed_messages
    kept = out[out.index(next(m for m in out if quoted_text(m).startswith(AUTOCOMPACT_MARKER))) + 1:]
    assert len([m for m in kept if m != user("more")]) <= DEGRADE_KEEP
    assert_invariants(h, out)


async def test_no_summariser_is_a_failure_hint() -> None:
    h = agent_history(40, 200)
    result = await run(make(None), h, 4000)
    assert result.steps == [] and result.compressed_messages is h
    assert any(hint.startswith("autocompact: summary failed") for hint in result.recovery_hints)


@pytest.mark.parametrize("share", [2, 3])
async def test_real_histories(share: int) -> None:
    c = counter()
    compacted = 0
    for name, h in real_histories(10):
        before = snapshot(h)
        fake = Scripted(reply=f"summary of {name}")
        s = make(fake)
        budget = max(1500, c.count_messages(h) // share)
        result = await run(s, h, budget)
        assert h == before, name
        if result is None:
            assert fake.calls == []
            continue
        out = result.compressed_messages
        assert_invariants(h, out)
        if not result.steps:
            continue
        compacted += 1
        assert len(fake.calls) == 1 and fake.calls[0][0]["content"] == SUMMARY_PROMPT
        notes = [m for m in out if m["role"] == "user" and quoted_text(m).startswith(AUTOCOMPACT_MARKER)]
        assert len(notes) == 1 and f"summary of {name}" in notes[0]["content"]
        assert out[-1] == h[-1]
        assert result.tokens_after == c.count_messages(out) and result.fits == (result.tokens_after <= budget)
    assert compacted > 50


async def test_the_summary_takes_only_the_room_the_kept_messages_leave() -> None:
    """At a budget the kept messages nearly fill, a summary sized by the budget alone would
    overshoot it; it is cut to what is left instead."""
    h = agent_history(20, 100)
    floor = (await run(make(Scripted(reply="x")), h, 1)).tokens_after  # everything but a 1-token summary
    budget = floor + 80
    result = await run(make(Scripted(reply=filler(400, 9))), h, budget)
    assert result.level_used is Level.AUTOCOMPACT
    assert result.fits and result.tokens_after <= budget
    assert filler(400, 9)[:100] in result.compressed_messages[2]["content"]


def test_a_shortened_summary_keeps_every_field_and_the_open_problems_and_files_longest() -> None:
    fields = [f"{k}. field {k}: " + filler(60, 30 + k) for k in range(1, 7)]
    fields[3] = "4. Unresolved problems: ValueError: bad input in parse() at src/app.py:12"
    summary = "\n".join(fields)
    short = shorten(summary, 120, counter())
    assert counter().count(short) <= 120
    lines = short.splitlines()
    assert [line[:2] for line in lines] == ["1.", "2.", "3.", "4.", "5.", "6."]
    assert fields[3] in lines, "the open problems line is kept whole when the others can make room"
    assert shorten("1. a\n2. b", 100, counter()) == "1. a\n2. b"
