"""Property tests: random histories, budgets and chains; the invariants of DESIGN.md hold."""
from __future__ import annotations

import asyncio
import json

import orjson
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ctxgate.pipeline.chain import build_pipeline
from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.microcompact import is_microcompacted
from ctxgate.pipeline.notes import with_notice
from ctxgate.pipeline.restore import extract_working_state
from ctxgate.pipeline.conversation import split_units
from ctxgate.pipeline.turns import first_user_index, is_valid_sequence, leading_instructions, newest_user_index
from ctxgate.pipeline.request import CompressionRequest

from pipeline_builders import counter, filler, last_unit, snapshot, tool_pairs_complete

LEVELS = ["snip", "microcompact", "collapse", "autocompact"]
SIZES = [0, 3, 20, 120, 600, 2500]
TOOLS = ["execute_bash", "str_replace_editor", "read_file", "search_flights", "TodoWrite", "update_plan"]
SHORT = ["ok", "Thanks!", "continue", "", "Please continue working on the task."]


@st.composite
def text(draw, seed: int) -> str:
    if draw(st.integers(0, 4)) == 0:
        return draw(st.sampled_from(SHORT))  # repeated short messages: equal fingerprints happen
    return filler(draw(st.sampled_from(SIZES)), seed)


def tool_args(name: str, i: int) -> dict:
    if name == "str_replace_editor":
        return {"command": "view", "path": f"/w/f{i % 3}.py"}
    if name == "read_file":
        return {"path": f"/w/r{i % 2}.py"}
    if name == "TodoWrite":
        return {"todos": [{"content": f"task {i}", "status": "pending"}]}
    if name == "update_plan":
        return {"plan": [{"step": f"step {i}", "status": "in_progress"}]}
    return {"command": f"run {i}"}


@st.composite
def histories(draw) -> list[dict]:
    msgs: list[dict] = [{"role": "system",
                         "content": "You are an agent. " + filler(draw(st.sampled_from([5, 300])), 1)}]
    if draw(st.booleans()):
        msgs.append({"role": "developer", "content": "Be terse."})
    if draw(st.integers(0, 5)) > 0:
        msgs.append({"role": "user", "content": "TASK: " + draw(text(2))})
    seed = 10
    swe_style = draw(st.booleans())
    for _ in range(draw(st.one_of(st.integers(0, 6), st.integers(6, 30)))):
        seed += 1
        kind = draw(st.sampled_from(["user", "assistant", "tools", "tools", "obs" if swe_style else "tools"]))
        if kind == "user":
            msgs.append({"role": "user", "content": draw(text(seed))})
        elif kind == "assistant":
            msgs.append({"role": "assistant", "content": draw(text(seed))})
        elif kind == "obs":  # SWE-agent: the command in assistant text, the observation as a user message
            msgs.append({"role": "assistant", "content": f"```\nls {seed}\n```"})
            msgs.append({"role": "user", "content": "OBSERVATION:\n" + filler(draw(st.sampled_from(SIZES)), seed)})
        else:
            n = draw(st.integers(0, 3))
            names = [draw(st.sampled_from(TOOLS)) for _ in range(n)]
            if n == 0:
                msgs.append({"role": "assistant", "content": draw(text(seed)), "tool_calls": []})
                continue
            ids = [f"call_{seed}_{k}" for k in range(n)]
            msgs.append({"role": "assistant", "content": draw(st.sampled_from(["", "Let me look."])), "tool_calls": [
                {"id": cid, "type": "function",
                 "function": {"name": name, "arguments": json.dumps(tool_args(name, seed))}}
                for cid, name in zip(ids, names)]})
            for k, cid in enumerate(ids):
                msgs.append({"role": "tool", "tool_call_id": cid,
                             "content": filler(draw(st.sampled_from(SIZES)), seed * 10 + k)})
    if draw(st.booleans()):
        msgs.append({"role": "user", "content": "NEWEST: " + draw(text(seed + 1))})
    assert is_valid_sequence(msgs)
    return msgs


class Summariser:
    def __init__(self, mode: str, size: int) -> None:
        self.mode, self.size, self.calls = mode, size, 0

    async def __call__(self, prompt: list[dict]) -> str:
        self.calls += 1
        if self.mode == "fail":
            raise RuntimeError("summariser down")
        # deterministic: depends only on what it was asked
        return f"- summary of {len(prompt[1]['content'])} chars\n" + filler(self.size, 3)


@st.composite
def levels(draw) -> list[str]:
    """Mostly the spec's order with some levels left out; sometimes any order."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.permutations(LEVELS))[:draw(st.integers(0, 4))]
    chosen = [name for name in LEVELS if draw(st.integers(0, 3)) > 0]
    return chosen or ["snip"]


@st.composite
def setups(draw) -> dict:
    return {
        "levels": draw(levels()),
        "keep_recent": draw(st.sampled_from([2, 5, 10, 20])),
        "window": draw(st.sampled_from([3, 15])),
        "pin": draw(st.booleans()),
        "restore": draw(st.booleans()),
        "reason": draw(st.sampled_from(["proactive", "reactive", "degrade"])),
        "summary": draw(st.sampled_from(["ok", "fail"])),
        "summary_size": draw(st.sampled_from([10, 2000])),
        "share": draw(st.one_of(st.floats(0.02, 0.3), st.floats(0.3, 1.0), st.floats(1.0, 1.2))),
    }


def run(history: list[dict], setup: dict):
    c = counter()
    total = c.count_messages(history)
    budget = max(20, int(total * setup["share"]))
    cfg = PipelineConfig(levels=setup["levels"], pin_first_user=setup["pin"],
                         snip={"keep_recent": setup["keep_recent"]}, collapse={"window": setup["window"]})
    state = extract_working_state(history, cfg.restore) if setup["restore"] else None
    summarise = Summariser(setup["summary"], setup["summary_size"])
    pipeline = build_pipeline(cfg, summarize=summarise, working_state=state, effective_budget=budget)
    result = asyncio.run(pipeline.compact(CompressionRequest(history, budget, c, setup["reason"])))
    return result, budget


PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])


@PROPS
@given(history=histories(), setup=setups())
def test_compact_keeps_every_invariant(history: list[dict], setup: dict) -> None:
    before = snapshot(history)
    result, budget = run(history, setup)
    out = result.compressed_messages
    c = counter()
    event("steps: " + (",".join(s.level.value for s in result.steps) or "none"))
    event(f"fits: {result.fits}")

    assert history == before, "the input list was mutated"
    assert is_valid_sequence(out), "not a sequence a provider accepts"
    assert tool_pairs_complete(out), "a tool call without its result, or an orphan result"
    k = leading_instructions(history)
    assert out[:k] == history[:k], "leading system/developer messages changed or moved"
    newest = newest_user_index(history)
    observation_cut = any("cut the newest observation" in h for h in result.recovery_hints)
    if newest is not None and observation_cut:
        # the one exception, the chain's last resort: an observation alone over the budget
        original = history[newest]["content"]
        assert newest != first_user_index(history)
        assert any(m.get("role") == "user" and is_microcompacted(m.get("content") or "")
                   and original.startswith(m["content"].split("\n... [middle")[0]) for m in out)
    elif newest is not None:
        assert history[newest] in out, "the newest user message is missing or changed"
    first = first_user_index(history)
    if setup["pin"] and first is not None and first == k:
        assert out[k] == history[first], "the pinned task statement moved or changed"
    # the turn in progress is never dropped (Microcompact may still cut a long output in it)
    if history:
        for m in last_unit(history):
            if m in out or (observation_cut and m is history[newest]):
                continue
            assert m["role"] == "tool", m
            twin = next(x for x in out if x.get("tool_call_id") == m["tool_call_id"])
            assert is_microcompacted(twin["content"])
    assert result.tokens_after == c.count_messages(with_notice(out)), "counted as forwarded, with the notice"
    assert result.fits == (result.tokens_after <= budget)
    if result.fits:
        assert c.count_messages(with_notice(out)) <= budget
    if not result.steps:
        assert out == history, "no step ran, yet the messages changed"
    for step in result.steps:
        assert step.tokens_after < step.tokens_before, f"{step.level.value} made the context bigger"
    # every cut falls between units of the input: what is left of a unit is all of it or a shortened copy
    kept_ids = {m.get("tool_call_id") for m in out if m.get("role") == "tool"}
    for u in split_units(history):
        head = history[u.start]
        if head.get("tool_calls"):
            ids = {tc["id"] for tc in head["tool_calls"]}
            assert ids <= kept_ids or not ids & kept_ids


@PROPS
@given(history=histories(), setup=setups())
def test_compact_is_deterministic(history: list[dict], setup: dict) -> None:
    """Same input, fresh session state: byte-identical output (the prompt cache depends on it)."""
    r1, _ = run(history, setup)
    r2, _ = run(snapshot(history), setup)
    assert orjson.dumps(r1.compressed_messages) == orjson.dumps(r2.compressed_messages)
    assert [s.level for s in r1.steps] == [s.level for s in r2.steps]
    assert r1.recovery_hints == r2.recovery_hints and r1.fits == r2.fits


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(history=histories(), setup=setups())
def test_compacting_the_result_again_keeps_invariants(history: list[dict], setup: dict) -> None:
    """A stateless client resends the compacted view: a second pass over it is still valid,
    and restore blocks are not stacked."""
    first, budget = run(history, setup)
    second, _ = run(first.compressed_messages, {**setup, "share": setup["share"] * 0.7})
    out = second.compressed_messages
    assert is_valid_sequence(out) and tool_pairs_complete(out)
    k = leading_instructions(history)
    assert out[:k] == history[:k]
    restore_blocks = [m for m in out if m["role"] == "system" and m["content"].startswith("[ctxgate: restored state]")]
    assert len(restore_blocks) == len({m["content"] for m in restore_blocks})
    assert len(restore_blocks) <= 8
