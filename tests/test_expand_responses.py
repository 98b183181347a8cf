"""Reversible compaction on the OpenAI Responses door, through a real `ctxgate serve` with the
`openai` SDK: the model's `function_call` of the gateway's tool is answered by the gateway
and never reaches the agent, streamed or not."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from servers import KEYS, Gateway, _model, launch, main_config, stop_all
from upstream import EXPAND_TOOL, REPLY, Received, ScriptedUpstream

MARKER = "MIDDLE-MARKER-4242"
TOOLS = [{"type": "function", "name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto")
    config["model_list"] += [_model(name, f"{upstream.url}/v1", max_input_tokens=128_000)
                             for name in ("gpt-4o-expand", "gpt-4o-expand-mixed")]
    gateway = launch("expand-responses", Path(tmp_path_factory.mktemp("expand-responses")), config).wait_ready()
    yield gateway
    stop_all([gateway])


def build_input() -> list[dict[str, Any]]:
    lines = [f"build step {i}: compiling module_{i}.c ok" for i in range(1500)]
    lines[750] = f"error: {MARKER} undefined reference to frobnicate"
    return [{"role": "user", "content": "Build the project and fix errors."},
            {"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": "{\"command\": \"make\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "\n".join(lines)},
            {"role": "user", "content": "What failed?"}]


def ask(gw: Gateway, model: str, stream: bool, items: list[dict[str, Any]] | None = None,
        session: str | None = None) -> Any:
    client = openai.OpenAI(base_url=gw.url, api_key=KEYS["acme"], max_retries=0, timeout=60)
    kw: dict[str, Any] = dict(model=model, instructions="You are a build agent.", input=items or build_input(),
                              tools=TOOLS, extra_headers={"X-Ctx-Budget": "6000",
                                                          "X-Ctx-Session": session or f"expr-{uuid.uuid4().hex[:12]}"})
    if not stream:
        return client.responses.create(**kw)
    with client.responses.stream(**kw) as events:
        return events.get_final_response()


def sent(up: ScriptedUpstream) -> list[Received]:
    return [r for r in up.log if r.door == "responses"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_agent_gets_the_final_response_and_the_upstream_the_original(gw: Gateway, up: ScriptedUpstream,
                                                                         stream: bool) -> None:
    response = ask(gw, "gpt-4o-expand", stream)
    assert [item.type for item in response.output] == ["message"] and response.output_text == REPLY
    first, second, *_ = sent(up)
    cut = json.dumps([first.body.get("instructions"), first.body["input"]])
    assert "ref ctx:" in cut and MARKER not in cut
    assert [t["name"] for t in first.body["tools"]] == ["bash", EXPAND_TOOL] and second.body["tools"] == \
        first.body["tools"]
    n = len(first.body["input"])
    assert second.body["input"][:n] == first.body["input"]
    assert second.body.get("instructions") == first.body.get("instructions")
    call, result = second.body["input"][n:]
    assert call["type"] == "function_call" and call["name"] == EXPAND_TOOL
    assert result["type"] == "function_call_output" and result["call_id"] == call["call_id"]
    assert MARKER in result["output"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_response_mixing_our_call_with_the_agents_keeps_only_the_agents(gw: Gateway, up: ScriptedUpstream,
                                                                           stream: bool) -> None:
    response = ask(gw, "gpt-4o-expand-mixed", stream)
    assert [(item.type, getattr(item, "name", None)) for item in response.output] == [("function_call", "bash")]
    assert len(sent(up)) == 1


def test_the_next_turn_starts_with_what_the_model_asked_for(gw: Gateway, up: ScriptedUpstream) -> None:
    session = f"expr-{uuid.uuid4().hex[:12]}"
    ask(gw, "gpt-4o-expand", False, session=session)
    last = sent(up)[-1].body["input"]
    up.reset()
    items = [*build_input(), {"role": "assistant", "content": REPLY}, {"role": "user", "content": "Fix it."}]
    ask(gw, "gpt-4o-expand", False, items, session)
    first = sent(up)[0].body["input"]
    assert first[:len(last)] == last and first[len(last):] == items[-2:]
