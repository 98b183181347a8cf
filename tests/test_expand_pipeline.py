"""Reversible compaction in the pipeline: every level names what it cut as `ref ctx:HEX` and
hands the original over in the request's `CutLog`; without one, notes are as before. And
the gateway's in-process content store: per tenant and session, bounded by size and age."""
from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from ctxgate.pipeline.autocompact import AutocompactStrategy
from ctxgate.pipeline.collapse import CollapseStore, CollapseStrategy
from ctxgate.pipeline.config import AutocompactConfig, CollapseConfig, MicrocompactConfig, PipelineConfig, SnipConfig
from ctxgate.pipeline.microcompact import MicrocompactStrategy, is_microcompacted
from ctxgate.pipeline.refs import CutLog, content_ref, render_span
from ctxgate.pipeline.snip import SnipStrategy
from ctxgate.pipeline.request import CompressionRequest
from ctxgate.proxy.config import Config
from ctxgate.proxy.engine.compaction import fingerprints_of
from ctxgate.proxy.engine.content_store import MemoryContentStore
from ctxgate.pipeline import planner
from ctxgate.proxy.engine.speculative import Speculator
from ctxgate.proxy.engine.state import MemorySessionStore, SessionState
from ctxgate.proxy.engine.turn_budget import Turn
from ctxgate.proxy.replay.driver import in_memory_sessions

from pipeline_builders import (LAST_UNIT, NO_WINDOW, agent_history, call, calls, chat_history, counter, filler, system,
                               tool, user)


REF = re.compile(r"ref (ctx:[0-9a-f]{12})")


def refs_in(messages: list[dict]) -> list[str]:
    return REF.findall(json.dumps(messages))


async def summarise(prompt: list[dict]) -> str:
    return "- goal: fix the test\n- done: ran pytest"


def test_a_ref_is_the_contents_own_short_hash() -> None:
    assert re.fullmatch(r"ctx:[0-9a-f]{12}", content_ref("x")) and content_ref("x") == content_ref("x")
    assert content_ref("x") != content_ref("y")


async def test_snip_names_the_dropped_messages() -> None:
    h = agent_history(30, 200)
    cuts = CutLog()
    result = await SnipStrategy(SnipConfig(keep_recent=20)).compress(
        CompressionRequest(h, 5000, counter(), window=LAST_UNIT, cuts=cuts))
    assert result is not None
    note = result.compressed_messages[2]["content"]
    ref, *steps = REF.findall(note)  # the span's, then each step's in the ledger
    dropped = [m for m in h if m not in result.compressed_messages]
    assert cuts.originals[ref] == render_span(dropped)
    assert steps and {ref, *steps} <= set(cuts.originals)
    folded = [s for s in steps if "ref ctx:" in cuts.originals[s]]  # a range: the lines it folded
    assert all(cuts.originals[s] in cuts.originals[ref] for s in steps if s not in folded)  # a step: one unit
    plain = await SnipStrategy(SnipConfig(keep_recent=20)).compress(CompressionRequest(h, 5000, counter(),
                                                                                       window=LAST_UNIT))
    assert plain is not None and "ref ctx:" not in plain.compressed_messages[2]["content"]


async def test_microcompact_names_the_middle_in_its_separator() -> None:
    original = filler(6000, 7)
    h = [system(), user("task"), calls(call("c1", "bash", command="x")), tool("c1", original), user("newest")]
    cuts = CutLog()
    result = await MicrocompactStrategy(MicrocompactConfig()).compress(
        CompressionRequest(h, 1, counter(), window=NO_WINDOW, cuts=cuts))
    assert result is not None
    cut = result.compressed_messages[3]["content"]
    [(n, ref)] = re.findall(r"\n\.\.\. \[middle (\d+) tokens truncated, ref (ctx:[0-9a-f]{12})\] \.\.\.\n", cut)
    middle = cuts.originals[ref]
    head, tail = cut.split("\n... [")[0], cut.rsplit("] ...\n", 1)[1]
    assert head + middle + tail == original and len(cuts.originals) == 1
    assert is_microcompacted(cut) and int(n) == counter().count(original) - counter().count(head + tail)


async def test_collapse_names_the_folded_span() -> None:
    h = chat_history(30, 40)
    cuts = CutLog()
    cfg = CollapseConfig()
    result = await CollapseStrategy(cfg, CollapseStore(cfg)).compress(
        CompressionRequest(h, 1, counter(), dialect="tool_calls", window=LAST_UNIT, cuts=cuts))
    assert result is not None
    [ref] = refs_in(result.compressed_messages)
    assert cuts.originals[ref] == render_span(h[2:31])


async def test_autocompact_names_the_summarised_history() -> None:
    h = agent_history(40, 200)
    cuts = CutLog()
    result = await AutocompactStrategy(AutocompactConfig(), summarise).compress(
        CompressionRequest(h, 4000, counter(), window=LAST_UNIT, cuts=cuts))
    ref, *steps = refs_in(result.compressed_messages)  # the span's, then the ledger's
    assert "[tool] line0x0 line0x1" in cuts.originals[ref]
    assert steps and all(s in cuts.originals for s in steps)


async def test_a_last_observation_cut_to_fit_is_named_and_kept() -> None:
    """The turn in progress alone over the budget: its last output is cut (the last resort after
    the chain), and its separator's reference is among the originals the record keeps."""
    h = [system(), user("task"), calls(call("c1", "bash", command="make")),
         tool("c1", filler(3000, 3) + "\nerror: boom in module\n" + filler(3000, 4))]
    turn = Turn(messages=h, fingerprints=fingerprints_of(h), tools=None, counter=counter(),
                config=PipelineConfig(), max_input_tokens=2000, summarize=summarise)
    run = await planner.plan(turn, SessionState("t", "s"), h, 1000, "proactive")
    cut = run.record.messages[-1]["content"]
    [ref] = REF.findall(cut)
    assert "truncated, ref" in cut and ref in run.cuts and run.cuts[ref] in h[-1]["content"]


async def test_the_content_store_keeps_each_sessions_own_within_its_bounds() -> None:
    store = MemoryContentStore(max_sessions=2)
    await store.put("t1", "s1", {"ctx:a": "alpha", "ctx:b": "beta"}, max_bytes=1000, ttl_s=60)
    assert await store.get("t1", "s1", "ctx:a", ttl_s=60) == "alpha"
    assert await store.get("t1", "s2", "ctx:a", ttl_s=60) is None  # another session
    assert await store.get("t2", "s1", "ctx:a", ttl_s=60) is None  # another tenant, the same session name
    await store.put("t1", "s1", {"ctx:c": "x" * 996}, max_bytes=1000, ttl_s=60)  # over the size: oldest out
    assert await store.get("t1", "s1", "ctx:a", ttl_s=60) is None
    assert await store.get("t1", "s1", "ctx:c", ttl_s=60) == "x" * 996
    time.sleep(0.02)
    assert await store.get("t1", "s1", "ctx:c", ttl_s=0.01) is None  # past its age
    await store.put("t1", "s2", {"ctx:d": "d"}, 1000, 60)
    assert await store.prune(60) == 0 and await store.prune(0.01) == 2  # s1's, past their age
    assert await store.get("t1", "s2", "ctx:d", ttl_s=60) == "d"
    await store.put("t1", "s1", {"ctx:c": "c"}, 1000, 60)
    await store.put("t1", "s3", {"ctx:e": "e"}, 1000, 60)  # a third session: the least recent goes
    assert await store.get("t1", "s2", "ctx:d", ttl_s=60) is None
    assert await store.get("t1", "s1", "ctx:c", ttl_s=60) == "c"


async def test_a_snip_note_summarised_by_autocompact_stays_expandable() -> None:
    """Autocompact's original is the span it summarised, the snip note in it included: the
    snip's original is kept too, reached through the summary's reference."""
    h = agent_history(40, 200)
    config = PipelineConfig(levels=["snip", "autocompact"], snip=SnipConfig(keep_recent=30))
    turn = Turn(messages=h, fingerprints=fingerprints_of(h), tools=None, counter=counter(), config=config,
                max_input_tokens=8000, summarize=summarise)
    run = await planner.plan(turn, SessionState("t", "s"), h, 2000, "proactive")
    assert run.record.levels == ["snip", "autocompact"]
    summary_ref = refs_in(run.record.messages)[0]
    snip_ref = REF.findall(run.cuts[summary_ref])[0]
    assert "[tool] line0x0" in run.cuts[snip_ref]


async def test_a_speculation_keeps_the_originals_its_notes_name() -> None:
    """A compaction made in the background is as reversible as one made in the turn: its
    originals are in the store by the time its record is adopted."""
    content = MemoryContentStore()
    speculator = Speculator(in_memory_sessions(MemorySessionStore()), content=content)
    h = agent_history(40, 200)
    config = PipelineConfig()
    turn = Turn(messages=h, fingerprints=fingerprints_of(h), tools=None, counter=counter(), config=config,
                max_input_tokens=8000, summarize=summarise)
    state = SessionState("t", "s")
    speculator.start(state, turn, h, 2000)
    await speculator.settle(state)
    await speculator.close()
    named = refs_in(state.speculative["record"]["messages"])
    assert named
    for ref in named:
        assert await content.get("t", "s", ref, config.expand.store_ttl_s)


async def test_a_failed_speculation_does_not_hold_up_the_turn_waiting_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn at the trigger waits in `settle` for the background compaction with the session
    locked; one that fails is cleared in a transaction of its own: the turn must learn of the
    failure first, or each waits for the other and the request never reaches the WAL."""
    async def failing(*_: object, **__: object) -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("the chain failed")

    monkeypatch.setattr(planner, "plan", failing)
    sessions = in_memory_sessions(MemorySessionStore())
    speculator = Speculator(sessions)
    h = agent_history(40, 200)
    turn = Turn(messages=h, fingerprints=fingerprints_of(h), tools=None, counter=counter(), config=PipelineConfig(),
                max_input_tokens=8000, summarize=summarise)
    async with sessions.transaction("t", "s") as tx:
        speculator.start(tx.state, turn, h, 2000)
    async with sessions.transaction("t", "s") as tx:  # the next turn, over the trigger
        await asyncio.wait_for(speculator.settle(tx.state), 5)
        assert not tx.state.speculation and not tx.state.speculative
    await asyncio.wait_for(speculator.close(), 5)
    assert not speculator.running("t", "s")


def test_expansion_is_off_for_minimal_on_for_the_others_and_per_tenant() -> None:
    config = Config.model_validate({"ctxgate": {"tenants": {
        "quiet": {"pipeline": {"expand": {"enabled": False}}},
        "eager": {"profile": "minimal", "pipeline": {"expand": {"enabled": True, "max_per_turn": 5}}}}}})
    assert [config.pipeline_config(p).expand.enabled for p in ("minimal", "professional", "enterprise")] == \
        [False, True, True]
    assert config.pipeline_config("professional", "quiet").expand.enabled is False
    eager = config.pipeline_config("minimal", "eager").expand
    assert eager.enabled and eager.max_per_turn == 5
