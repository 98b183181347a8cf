"""Anthropic's context editing on the Messages door, on an OpenAI-compatible route (docs/native-context.md):
the official `anthropic` SDK against a real `ctxgate serve` in front of the scripted upstream; and the
clearing itself (pipeline/context_edits.py) on plain message lists."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import anthropic
import pytest

from ctxgate.pipeline.context_edits import CLEARED, clear_thinking, clear_tool_uses
from servers import KEYS, Gateway, launch, main_config, stop_all
from upstream import ScriptedUpstream

BIG = "".join(f"line {k}: build output that fills the context with words\n" for k in range(40))
BETA = ["context-management-2025-06-27"]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = launch("native-edits", tmp_path_factory.mktemp("native-edits"), main_config(upstream.url, "auto"))
    yield gateway.wait_ready()
    stop_all([gateway])


def client(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url.rsplit("/v1", 1)[0], api_key=KEYS["acme"], max_retries=0,
                               default_headers={"X-Ctx-Session": f"edits-{uuid.uuid4().hex[:12]}"})


def session(steps: int = 8, tool: str = "bash") -> list[dict[str, Any]]:
    """Claude Code's shape: a task, then tool_use / tool_result turns, then a question."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix the build."}]
    for i in range(steps):
        name = "read" if i == 1 else tool
        msgs.append({"role": "assistant", "content": [
            {"type": "text", "text": f"step {i}"},
            {"type": "tool_use", "id": f"t{i}", "name": name, "input": {"command": f"make step{i} INPUT-{i}"}}]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"RESULT-{i}\n" + BIG}]})
    msgs.append({"role": "assistant", "content": "Done?"})
    msgs.append({"role": "user", "content": "Check again."})
    return msgs


def forwarded(up: ScriptedUpstream, start: int) -> str:
    return json.dumps([r.body for r in up.log[start:]])


def test_clear_tool_uses_on_an_openai_route(gw: Gateway, up: ScriptedUpstream) -> None:
    start = len(up.log)
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1000},
            "keep": {"type": "tool_uses", "value": 2}, "exclude_tools": ["read"], "clear_tool_inputs": True}
    reply = client(gw).beta.messages.create(model="gpt-4o", max_tokens=64, messages=session(),  # type: ignore[arg-type]
                                            context_management={"edits": [edit]}, betas=BETA)  # type: ignore[list-item]
    sent = forwarded(up, start)
    assert [f"RESULT-{i}" in sent for i in range(8)] == [False, True, False, False, False, False, True, True]
    assert "INPUT-0" not in sent and "INPUT-1" in sent and "INPUT-7" in sent  # inputs cleared with their results
    assert "context_management" not in sent
    assert reply.context_management is not None
    [applied] = reply.context_management.applied_edits
    assert applied.type == "clear_tool_uses_20250919" and applied.cleared_tool_uses == 5  # type: ignore[union-attr]
    assert applied.cleared_input_tokens > 1000


def test_streamed_reply_reports_the_edits(gw: Gateway, up: ScriptedUpstream) -> None:
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 3}}
    with client(gw).beta.messages.stream(model="gpt-4o", max_tokens=64, messages=session(),  # type: ignore[arg-type]
                                         context_management={"edits": [edit]}, betas=BETA) as stream:  # type: ignore[list-item]
        final = stream.get_final_message()
    assert final.context_management is not None
    assert final.context_management.applied_edits[0].cleared_tool_uses == 5  # type: ignore[union-attr]


def test_under_the_trigger_nothing_is_cleared(gw: Gateway, up: ScriptedUpstream) -> None:
    start = len(up.log)
    reply = client(gw).beta.messages.create(model="gpt-4o", max_tokens=64, messages=session(),  # type: ignore[arg-type]
                                            context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},  # type: ignore[list-item]
                                            betas=BETA)
    assert all(f"RESULT-{i}" in forwarded(up, start) for i in range(8))
    assert reply.context_management is not None and reply.context_management.applied_edits == []


@pytest.mark.parametrize("edits, param", [
    ([{"type": "clear_everything_2099"}], "context_management.edits.0.type"),
    ([{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
       "keep": {"type": "tool_uses", "value": 5}}], "context_management.edits.0.keep"),
    ([{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}], "context_management.edits.1.type"),
    ([{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 100}}],
     "context_management.edits.0.trigger.value"),
    ([{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": -1}}],
     "context_management.edits.0.trigger.value"),
])
def test_bad_edits_are_a_400_naming_the_field(gw: Gateway, up: ScriptedUpstream, edits: list[dict[str, Any]],
                                              param: str) -> None:
    start = len(up.log)
    with pytest.raises(anthropic.BadRequestError) as e:
        client(gw).beta.messages.create(model="gpt-4o", max_tokens=64, messages=session(),  # type: ignore[arg-type]
                                        context_management={"edits": edits}, betas=BETA)  # type: ignore[typeddict-item]
    assert e.value.body["type"] == "error" and param in e.value.body["error"]["message"]  # type: ignore[index]
    assert len(up.log) == start


def _count(text: str) -> int:
    return len(text) // 4


def test_clear_at_least_leaves_everything_when_too_little_goes() -> None:
    msgs = session()
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
            "clear_at_least": {"type": "input_tokens", "value": 10_000_000}}
    assert clear_tool_uses(msgs, edit, 0, _count) == (msgs, None)


def test_clear_tool_inputs_by_name_and_results_already_cleared() -> None:
    msgs = session(tool="grep")
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
            "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": ["read"]}
    out, applied = clear_tool_uses(msgs, edit, 0, _count)
    assert applied is not None and applied.cleared == 7
    assert out[3]["content"][1]["input"] == {} and out[1]["content"][1]["input"]  # only `read`'s input goes
    assert out[2]["content"][0]["content"] == CLEARED and msgs[2]["content"][0]["content"] != CLEARED
    again, second = clear_tool_uses(out, edit, 0, _count)
    assert second is None and again == out  # nothing new to clear


def test_clear_thinking_keeps_the_newest_turns() -> None:
    def turn(i: int) -> dict[str, Any]:
        return {"role": "assistant", "content": [{"type": "thinking", "thinking": f"THOUGHT-{i}", "signature": "s"},
                                                 {"type": "text", "text": f"answer {i}"}]}
    msgs = [{"role": "user", "content": "q"}, turn(0), {"role": "user", "content": "q"}, turn(1),
            {"role": "user", "content": "q"}, turn(2), {"role": "user", "content": "q"}]
    out, applied = clear_thinking(msgs, {"type": "clear_thinking_20251015",
                                         "keep": {"type": "thinking_turns", "value": 2}}, _count)
    assert applied is not None and applied.cleared == 1
    assert "THOUGHT-0" not in json.dumps(out) and "THOUGHT-1" in json.dumps(out) and "THOUGHT-2" in json.dumps(out)
    assert clear_thinking(msgs, {"type": "clear_thinking_20251015", "keep": "all"}, _count) == (msgs, None)


def long_session() -> list[dict[str, Any]]:
    """Past compact_20260112's least trigger (50,000 tokens)."""
    msgs = session()
    msgs[0] = {"role": "user", "content": "Fix the build. The secret word is PELICAN."}
    for m in msgs:
        for block in m["content"] if isinstance(m["content"], list) else []:
            if block.get("type") == "tool_result":
                block["content"] += BIG * 25
    return msgs


COMPACT = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50_000}}


def test_compact_paused_then_the_block_comes_back(gw: Gateway, up: ScriptedUpstream) -> None:
    cli = client(gw)
    start = len(up.log)
    edit = {**COMPACT, "pause_after_compaction": True, "instructions": "Keep the SECRET-WORD-RULE."}
    reply = cli.beta.messages.create(model="gpt-4o", max_tokens=64, messages=long_session(),  # type: ignore[arg-type]
                                     context_management={"edits": [edit]},  # type: ignore[list-item]
                                     betas=["compact-2026-01-12"])
    assert reply.stop_reason == "compaction" and [b.type for b in reply.content] == ["compaction"]
    block = reply.content[0]
    assert block.encrypted_content and block.encrypted_content.startswith("ctxs1.")  # type: ignore[union-attr]
    assert all(r.body.get("model") == "summarizer" for r in up.log[start:])  # no model turn
    start = len(up.log)
    cli.beta.messages.create(model="gpt-4o", max_tokens=64, betas=["compact-2026-01-12"], messages=[  # type: ignore[list-item]
        {"role": "user", "content": "Fix the build."}, {"role": "assistant", "content": [block.model_dump()]},
        {"role": "user", "content": "What is the secret word?"}])
    sent = forwarded(up, start)
    assert block.encrypted_content not in sent and "PELICAN" in sent and "What is the secret word?" in sent  # type: ignore[union-attr]


def test_compact_goes_first_in_the_reply_whole_and_streamed(gw: Gateway, up: ScriptedUpstream) -> None:
    cli = client(gw)
    reply = cli.beta.messages.create(model="gpt-4o", max_tokens=64, messages=long_session(),  # type: ignore[arg-type]
                                     context_management={"edits": [COMPACT]}, betas=["compact-2026-01-12"])  # type: ignore[list-item]
    assert [b.type for b in reply.content][:2] == ["compaction", "text"]
    assert reply.usage.iterations and reply.usage.iterations[0].type == "compaction"
    with client(gw).beta.messages.stream(model="gpt-4o", max_tokens=64, messages=long_session(),  # type: ignore[arg-type]
                                         context_management={"edits": [COMPACT]},  # type: ignore[list-item]
                                         betas=["compact-2026-01-12"]) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "compaction" and final.content[0].encrypted_content  # type: ignore[union-attr]
    assert final.content[1].type == "text"



def talk_session() -> list[dict[str, Any]]:
    """Past the trigger in talk alone: no tool output for microcompact to clear."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Plan the migration. The secret word is PELICAN."}]
    for i in range(24):
        msgs.append({"role": "assistant", "content": f"Plan part {i}: " + " ".join(
            f"phase {i}.{k} moves table t{i}_{k} after its readers, then checks the counts." for k in range(120))})
        msgs.append({"role": "user", "content": f"Go on with part {i + 1}."})
    return msgs


def test_compact_summary_reads_the_edits_instructions(upstream: ScriptedUpstream, up: ScriptedUpstream,
                                                     tmp_path: Path) -> None:
    """A gateway whose only level cheaper than a summary is microcompact, on a session it
    cannot shrink: Autocompact's summary runs, and the edit's `instructions` are in its prompt."""
    config = main_config(upstream.url, "auto")
    config["ctxgate"]["pipeline"]["levels"] = ["microcompact", "autocompact"]
    summarizing = launch("native-summary", tmp_path, config).wait_ready()
    try:
        edit = {**COMPACT, "instructions": "Keep every table name that starts with ZEBRA-RULE."}
        cli: Any = client(summarizing)  # the SDK's types list only Anthropic's own models and shapes
        reply = cli.beta.messages.create(model="gpt-4o", max_tokens=64, messages=talk_session(),
                                         context_management={"edits": [edit]}, betas=["compact-2026-01-12"])
    finally:
        stop_all([summarizing])
    assert [b.type for b in reply.content][:2] == ["compaction", "text"]
    summaries = [json.dumps(r.body) for r in up.log if r.body.get("model") == "summarizer"]
    assert summaries, "the compaction ran no summary"
    assert all("ZEBRA-RULE" in s for s in summaries)  # the client's instructions reach the summariser
    turn = [json.dumps(r.body) for r in up.log if r.body.get("model") == "gpt-4o"]
    assert len(turn) == 1 and "ZEBRA-RULE" not in turn[0]  # and only the summariser
    assert reply.usage.iterations and reply.usage.iterations[0].input_tokens > 0  # its cost, the summary's


def test_count_tokens_reports_the_count_before_the_edits(gw: Gateway, up: ScriptedUpstream) -> None:
    """Anthropic's count_tokens with context_management: `input_tokens` after the edits,
    `context_management.original_input_tokens` before them."""
    cli: Any = client(gw)
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1000},
            "keep": {"type": "tool_uses", "value": 2}}
    start = len(up.log)
    counted = cli.beta.messages.count_tokens(model="gpt-4o", messages=session(),
                                             context_management={"edits": [edit]}, betas=BETA)
    whole = cli.beta.messages.count_tokens(model="gpt-4o", messages=session(), betas=BETA)
    assert whole.context_management is None  # no edits asked, none reported
    assert counted.context_management.original_input_tokens > counted.input_tokens
    assert abs(counted.context_management.original_input_tokens - whole.input_tokens) <= whole.input_tokens // 20
    assert counted.input_tokens < whole.input_tokens * 0.6  # six of eight tool results cleared
    assert len(up.log) == start  # counted by ctxgate: no model call
