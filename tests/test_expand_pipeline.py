"""Reversible compaction in the pipeline: every level names what it cut as `ref ctx:HEX` and
hands the original over in the request's `CutLog`; without one, notes are as before. And
the gateway's in-process content store: per tenant and session, bounded by size and age."""
from __future__ import annotations

import json
import re
import time

from ctxgate.pipeline.autocompact import AutocompactStrategy
from ctxgate.pipeline.chain import build_pipeline
from ctxgate.pipeline.collapse import CollapseStore, CollapseStrategy
from ctxgate.pipeline.config import AutocompactConfig, CollapseConfig, MicrocompactConfig, PipelineConfig, SnipConfig
from ctxgate.pipeline.microcompact import MicrocompactStrategy, cut_ref
from ctxgate.pipeline.refs import CutLog, content_ref, render_span
from ctxgate.pipeline.restore import WorkingState
from ctxgate.pipeline.snip import SnipStrategy
from ctxgate.pipeline.types import CompressionRequest
from ctxgate.proxy.config import Config
from ctxgate.proxy.engine.content_store import MemoryContentStore

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
    [ref] = REF.findall(note)
    dropped = [m for m in h if m not in result.compressed_messages]
    assert cuts.originals == {ref: render_span(dropped)}
    plain = await SnipStrategy(SnipConfig(keep_recent=20)).compress(CompressionRequest(h, 5000, counter(),
                                                                                       window=LAST_UNIT))
    assert plain is not None and "ref ctx:" not in plain.compressed_messages[2]["content"]


async def test_microcompact_keeps_the_middle_under_the_cut_texts_ref() -> None:
    original = filler(6000, 7)
    h = [system(), user("task"), calls(call("c1", "bash", command="x")), tool("c1", original), user("newest")]
    cuts = CutLog()
    result = await MicrocompactStrategy(MicrocompactConfig()).compress(
        CompressionRequest(h, 1, counter(), window=NO_WINDOW, cuts=cuts))
    assert result is not None
    cut = result.compressed_messages[3]["content"]
    middle = cuts.originals[cut_ref(cut)]
    head, tail = cut.split("\n... [")[0], cut.rsplit("] ...\n", 1)[1]
    assert head + middle + tail == original and len(cuts.originals) == 1


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
    [ref] = refs_in(result.compressed_messages)
    assert "[tool] line0x0 line0x1" in cuts.originals[ref]


async def test_the_chain_lists_cut_outputs_in_its_restore_block() -> None:
    h = [system(), user("task"), calls(call("c1", "bash", command="make")),
         tool("c1", filler(3000, 3) + "\nerror: boom in module\n" + filler(3000, 4)), user("what failed?")]
    cuts = CutLog()
    pipeline = build_pipeline(PipelineConfig(levels=["microcompact"]), working_state=WorkingState(last_error="x"),
                              effective_budget=4000)
    result = await pipeline.compact(CompressionRequest(h, 2000, counter(), window=NO_WINDOW, cuts=cuts))
    cut = next(m["content"] for m in result.compressed_messages if m.get("role") == "tool")
    listed = [m["content"] for m in result.compressed_messages if "middle is kept by reference" in str(m["content"])]
    assert len(listed) == 1 and f"ref {cut_ref(cut)}" in listed[0] and cut_ref(cut) in cuts.originals


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
    await store.put("t1", "s3", {"ctx:e": "e"}, 1000, 60)  # a third session: the least recent goes
    assert await store.get("t1", "s1", "ctx:c", ttl_s=60) is None


def test_expansion_is_off_for_minimal_on_for_the_others_and_per_tenant() -> None:
    config = Config.model_validate({"ctxgate": {"tenants": {
        "quiet": {"pipeline": {"expand": {"enabled": False}}},
        "eager": {"profile": "minimal", "pipeline": {"expand": {"enabled": True, "max_per_turn": 5}}}}}})
    assert [config.pipeline_config(p).expand.enabled for p in ("minimal", "professional", "enterprise")] == \
        [False, True, True]
    assert config.pipeline_config("professional", "quiet").expand.enabled is False
    eager = config.pipeline_config("minimal", "eager").expand
    assert eager.enabled and eager.max_per_turn == 5
