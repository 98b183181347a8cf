"""Reversible compaction on the Anthropic Messages door, through a real `ctxgate serve` with
the `anthropic` SDK: the model's `tool_use` of the gateway's tool is answered by the gateway
and never reaches the agent, streamed or not."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import anthropic
import pytest

from servers import UPSTREAM_KEY, Gateway, launch, main_config, stop_all
from upstream import EXPAND_TOOL, REPLY, Received, ScriptedUpstream

KEY = "sk-claude-expand"
MARKER = "MIDDLE-MARKER-4242"
TOOLS = [{"name": "bash", "description": "Run a shell command.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto")
    config["model_list"] += [{"model_name": name, "model_info": {"max_input_tokens": 100_000}, "litellm_params": {
        "model": f"anthropic/{name}", "api_base": upstream.url, "api_key": UPSTREAM_KEY}}
        for name in ("claude-expand", "claude-expand-mixed")]
    config["ctxgate"]["tenants"]["claude"] = {"api_keys": [KEY], "allow_overrides": ["budget"]}
    gateway = launch("expand-messages", Path(tmp_path_factory.mktemp("expand-messages")), config).wait_ready()
    yield gateway
    stop_all([gateway])


def build_log() -> list[dict[str, Any]]:
    lines = [f"build step {i}: compiling module_{i}.c ok" for i in range(1500)]
    lines[750] = f"error: {MARKER} undefined reference to frobnicate"
    return [{"role": "user", "content": "Build the project and fix errors."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "bash",
                                               "input": {"command": "make"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": "\n".join(lines)}]},
            {"role": "assistant", "content": "The build printed a long log."},
            {"role": "user", "content": "What failed?"}]


def ask(gw: Gateway, model: str, stream: bool, messages: list[dict[str, Any]] | None = None,
        session: str | None = None) -> anthropic.types.Message:
    client = anthropic.Anthropic(base_url=gw.base, api_key=KEY, max_retries=0, timeout=60)
    kw: dict[str, Any] = dict(model=model, max_tokens=64, system="You are a build agent.",
                              messages=messages or build_log(), tools=TOOLS,
                              extra_headers={"X-Ctx-Budget": "6000",
                                             "X-Ctx-Session": session or f"expm-{uuid.uuid4().hex[:12]}"})
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as events:
        return events.get_final_message()


def sent(up: ScriptedUpstream) -> list[Received]:
    return [r for r in up.log if r.door == "messages"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_agent_gets_the_final_message_and_the_upstream_the_original(gw: Gateway, up: ScriptedUpstream,
                                                                        stream: bool) -> None:
    message = ask(gw, "claude-expand", stream)
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", REPLY)]
    assert message.stop_reason == "end_turn"
    first, second, *_ = sent(up)
    cut = json.dumps([first.body.get("system"), first.body["messages"]])
    assert "ref ctx:" in cut and MARKER not in cut
    assert [t["name"] for t in first.body["tools"]] == ["bash", EXPAND_TOOL] and second.body["tools"] == \
        first.body["tools"]
    n = len(first.body["messages"])
    assert second.body["messages"][:n] == first.body["messages"] and second.body["system"] == first.body["system"]
    call, results = second.body["messages"][n:]
    assert call["role"] == "assistant" and call["content"][-1]["name"] == EXPAND_TOOL
    assert results["role"] == "user" and MARKER in results["content"][0]["content"]
    assert results["content"][0]["tool_use_id"] == call["content"][-1]["id"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_message_mixing_our_call_with_the_agents_keeps_only_the_agents(gw: Gateway, up: ScriptedUpstream,
                                                                          stream: bool) -> None:
    message = ask(gw, "claude-expand-mixed", stream)
    assert [(b.type, getattr(b, "name", None)) for b in message.content] == [("tool_use", "bash")]
    assert message.stop_reason == "tool_use" and len(sent(up)) == 1


def test_the_next_turn_starts_with_what_the_model_asked_for(gw: Gateway, up: ScriptedUpstream) -> None:
    session = f"expm-{uuid.uuid4().hex[:12]}"
    ask(gw, "claude-expand", False, session=session)
    last = sent(up)[-1].body["messages"]
    up.reset()
    messages = [*build_log(), {"role": "assistant", "content": REPLY}, {"role": "user", "content": "Fix it."}]
    ask(gw, "claude-expand", False, messages, session)
    first = sent(up)[0].body["messages"]
    assert first[:len(last)] == last and first[len(last):] == messages[-2:]
