"""No summary paid for nothing (issue 36, item 9): a background (speculative) summary is
dropped only when its span is gone from the history, and every summary paid for whose note is
never sent is counted, in /metrics and in `ctxgate replay`'s figures."""
from __future__ import annotations

import re
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.fingerprint import prefix_hashes
from ctxgate.pipeline.notes import SUMMARY, context_note
from ctxgate.proxy.engine.compaction import Compactor, fingerprints_of
from ctxgate.proxy.engine.content_store import MemoryContentStore
from ctxgate.proxy.engine.state import CompactionRecord, SessionState
from ctxgate.proxy.engine.summary_cost import SummaryCost, costed
from ctxgate.proxy.engine.summary_reuse import reusing_summaries
from ctxgate.proxy.engine.turn_budget import Turn
from ctxgate.proxy.replay.driver import replay
from pipeline_builders import Message, bash_step, counter, filler, system, tool_turn, user
from servers import ADMIN_KEY, KEYS, Gateway, launch, main_config, stop_all, wait_until
from upstream import ScriptedUpstream

BUDGET = 4000
SUMMARY_TEXT = "1. goal\n2. steps\n3. decisions\n4. open\n5. files\n6. tools"


def _turn(messages: list[Message], summarize: Any) -> Turn:
    return Turn(messages=messages, fingerprints=fingerprints_of(messages), tools=None, counter=counter(),
                config=PipelineConfig(), max_input_tokens=BUDGET, summarize=summarize)


def _near_trigger() -> list[Message]:
    trigger = 0.85 * PipelineConfig().effective_budget(BUDGET)
    history = [system(), user("TASK: fix the failing test in src/app.py")]
    i = 0
    for size in (200, 10):
        while counter().count_messages(history + tool_turn(i, size=size)) < trigger:
            history += tool_turn(i, size=size)
            i += 1
    return history


def _speculation(history: list[Message], k: int, note: Message) -> dict[str, Any]:
    """A background compaction of history[:k] whose summary cost 1,234 tokens, as the speculator leaves it."""
    record = CompactionRecord(prefix_len=k, prefix_hash=prefix_hashes(fingerprints_of(history[:k]))[-1],
                              messages=history[:2] + [note], levels=["autocompact"], tokens_before=0,
                              tokens_after=0, created_at=0.0)
    return {"record": asdict(record), "collapse": {}, "breaker": {}, "working": {},
            "summary": {"calls": 1, "tokens": 1234}}


def _note(text: str) -> Message:
    return context_note(SUMMARY, "ctxgate:autocompact", text)


async def test_a_background_summary_that_leaves_too_little_room_is_kept_and_compacted_on() -> None:
    """Made long ago, the speculation covers only the oldest steps, and with everything since it
    is over the watermark: its summary is kept all the same (its note reaches the upstream), and
    what came since is compacted on top of it at this point; nothing is counted as waste."""
    history = _near_trigger()
    grown = history + tool_turn(99, size=60)
    note = _note(f"the background summary {uuid.uuid4().hex}")
    state = SessionState("t", "s")
    state.speculative = _speculation(grown, 6, note)
    wasted: list[tuple[str, int, int]] = []
    summaries = 0

    async def summarize(_: list[Message]) -> str:
        nonlocal summaries
        summaries += 1
        return SUMMARY_TEXT

    compactor = Compactor(on_waste=lambda *w: wasted.append(w))
    plan = await compactor.prepare(state, _turn(grown, summarize))
    assert note in plan.messages, "the background summary's note is forwarded"
    assert wasted == [] and not state.speculative
    assert state.speculation_wasted == 1, "a session that grows this fast stops speculating"
    assert plan.levels and counter().count_messages(plan.messages) < counter().count_messages(grown)
    assert plan.messages[-1] == grown[-1]


async def test_a_background_summary_whose_span_is_gone_is_dropped_and_counted() -> None:
    """The client rewrote its history (the task edited): the span the background summary covers
    is not the client's any more, so it is dropped, and counted: one summary, its tokens."""
    history = _near_trigger()
    grown = history + tool_turn(99, size=60)
    note = _note("a summary of a history the client no longer has")
    state = SessionState("t", "s")
    state.speculative = _speculation(grown, 6, note)
    rewritten = [grown[0], user("TASK: fix the failing test in src/other.py"), *grown[2:]]
    wasted: list[tuple[str, int, int]] = []

    async def summarize(_: list[Message]) -> str:
        return SUMMARY_TEXT

    plan = await Compactor(on_waste=lambda *w: wasted.append(w)).prepare(state, _turn(rewritten, summarize))
    assert note not in plan.messages and not state.speculative
    assert wasted == [("stale", 1, 1234)]


async def test_a_replay_counts_a_background_summary_never_needed() -> None:
    """A session that passes the watermark, gets its background summary and then ends before the
    trigger: `ctxgate replay`'s figures count that summary as paid for nothing."""
    config = PipelineConfig.model_validate({"levels": ["autocompact"], "cost": {"depth": "target"}})
    budget = config.effective_budget(BUDGET)
    messages: list[Message] = [system(), user("TASK: fix the failing test in src/app.py")]
    i = 0
    while counter().count_messages(messages) < 0.75 * budget:
        messages += bash_step(i, filler(150, i))
        i += 1
    messages += [{"role": "assistant", "content": "All checked."}]
    calls = 0

    async def summarize(_: list[Message]) -> str:
        nonlocal calls
        calls += 1
        return SUMMARY_TEXT

    run = await replay(messages, None, BUDGET, counter=counter(), summarize=summarize, config=config,
                       wait_background=True)
    assert run.points == 0 and calls == 1, (run.points, calls)
    assert [(why, n) for why, n, _ in run.wasted] == [("unneeded", 1)] and run.wasted[0][2] > 0


# -- through a real gateway: /metrics ------------------------------------------------------------
@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto")
    # Autocompact alone, aiming at the profile's target: a speculation always asks for a summary.
    config["ctxgate"]["pipeline"] = {"levels": ["autocompact"], "cost": {"depth": "target"},
                                     "autocompact": {"model": "summarizer"}}
    gateway = launch("summary-waste", Path(tmp_path_factory.mktemp("summary-waste")), config).wait_ready()
    yield gateway
    stop_all([gateway])


def _chat(gw: Gateway, messages: list[Message], session: str) -> httpx.Response:
    resp = httpx.post(gw.url + "/chat/completions", json={"model": "gpt-4o", "messages": messages},
                      headers={"Authorization": f"Bearer {KEYS['acme']}", "X-Ctx-Session": session,
                               "X-Ctx-Budget": str(BUDGET)}, timeout=60)
    assert resp.status_code == 200, resp.text[:500]
    return resp


def _wasted(gw: Gateway, reason: str) -> tuple[float, float]:
    status, text = gw.get("/metrics", {"Authorization": f"Bearer {ADMIN_KEY}"})
    assert status == 200, text

    def value(name: str) -> float:
        found = re.search(rf'^{name}_total{{reason="{reason}"}} ([0-9.e+]+)$', text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0
    return value("ctxgate_summaries_wasted"), value("ctxgate_summary_tokens_wasted")


def test_a_background_summary_dropped_with_its_span_shows_in_the_metrics(gw: Gateway, up: ScriptedUpstream) -> None:
    """Past the watermark the gateway summarises in the background; the agent then sends its
    history rewritten (its task edited) and over the trigger: the background summary is of a
    span the history no longer has, so it is dropped, and /metrics counts it with its tokens."""
    session = f"waste-{uuid.uuid4().hex[:8]}"
    budget = PipelineConfig().effective_budget(BUDGET)
    messages: list[Message] = [system(), user("TASK: fix the failing test in src/app.py")]
    i = 0
    while counter().count_messages(messages) < 0.75 * budget:
        messages += bash_step(i, filler(150, i))
        i += 1
    before = _wasted(gw, "stale")
    since = len(up.log)
    _chat(gw, messages, session)  # past the watermark: the background summary starts
    # (The turn at the trigger waits for a background compaction still in flight.)
    wait_until(lambda: any("summarizer" in str((r.body or {}).get("model")) for r in up.log[since:]),
               timeout=30, what="the background summary")
    rewritten = [messages[0], user("TASK: fix the failing test in src/other.py"), *messages[2:]]
    while counter().count_messages(rewritten) < 0.9 * budget:
        rewritten += bash_step(i, filler(150, i))
        i += 1
    resp = _chat(gw, rewritten, session)
    assert resp.headers["x-ctx-levels"] != "none", "the rewritten history is compacted afresh"
    after = _wasted(gw, "stale")
    assert after[0] == before[0] + 1 and after[1] > before[1], (before, after)


async def test_a_summary_an_earlier_attempt_paid_for_is_not_counted_again() -> None:
    """A retried compaction reads its summary back from the content store (`summary_reuse`):
    the retry's cost counts no second call, so no waste is reported for a summary paid once."""
    paid: list[list[Message]] = []

    async def complete(model: str, prompt: list[Message]) -> str:
        paid.append(prompt)
        return SUMMARY_TEXT

    store = MemoryContentStore()
    summarize = reusing_summaries(store, "acme", "s-1", "gpt-4o", PipelineConfig().expand, complete)
    prompt = [user("summarise: steps 1-3")]
    first, retry = SummaryCost(), SummaryCost()
    assert await costed(_turn([system()], summarize), first).summarize(prompt) == SUMMARY_TEXT
    assert await costed(_turn([system()], summarize), retry).summarize(prompt) == SUMMARY_TEXT
    assert len(paid) == 1 and first.calls == 1 and first.tokens > 0
    assert retry == SummaryCost()
    await costed(_turn([system()], summarize), retry).summarize([user("summarise: steps 4-6")])
    assert len(paid) == 2 and retry.calls == 1
