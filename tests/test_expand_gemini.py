"""Reversible compaction on the Gemini door, through a real `ctxgate serve` with the
`google-genai` SDK: the expansion tool is offered as a functionDeclaration, the model's
`functionCall` of it is answered by the gateway, and the agent gets only the final answer,
whole or streamed."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from google import genai
from google.genai import types

from servers import KEYS, Gateway, launch, stop_all
from test_expand_chat import MARKER, expand_config
from upstream import EXPAND_TOOL, REPLY, Received, ScriptedUpstream

TOOL = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="run_shell_command", description="Run a shell command.",
    parameters_json_schema={"type": "object", "properties": {"command": {"type": "string"}}})])
_CLIENTS: list[genai.Client] = []


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = launch("expand-gemini", Path(tmp_path_factory.mktemp("expand-gemini")),
                     expand_config(upstream)).wait_ready()
    yield gateway
    stop_all([gateway])


def build_log() -> list[dict[str, Any]]:
    lines = [f"build step {i}: compiling module_{i}.c ok" for i in range(1500)]
    lines[750] = f"error: {MARKER} undefined reference to frobnicate"
    return [{"role": "user", "parts": [{"text": "Build the project and fix errors."}]},
            {"role": "model", "parts": [{"functionCall": {"name": "run_shell_command", "args": {"command": "make"}}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "run_shell_command",
                                                             "response": {"output": "\n".join(lines)}}}]},
            {"role": "model", "parts": [{"text": "The build printed a long log."}]},
            {"role": "user", "parts": [{"text": "What failed?"}]}]


def chats(up: ScriptedUpstream) -> list[Received]:
    return [r for r in up.chats() if r.body and r.body.get("model") != "summarizer"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_agent_gets_the_final_answer_and_the_upstream_the_original(gw: Gateway, up: ScriptedUpstream,
                                                                       stream: bool) -> None:
    headers = {"X-Ctx-Budget": "6000", "X-Ctx-Session": f"expg-{uuid.uuid4().hex[:12]}"}
    cli = genai.Client(api_key=KEYS["acme"], http_options=types.HttpOptions(base_url=gw.base, headers=headers))
    _CLIENTS.append(cli)
    config = types.GenerateContentConfig(system_instruction="You are a build agent.", tools=[TOOL])
    contents: Any = build_log()
    if stream:
        chunks = list(cli.models.generate_content_stream(model="gpt-4o-expand", contents=contents, config=config))
    else:
        chunks = [cli.models.generate_content(model="gpt-4o-expand", contents=contents, config=config)]
    assert "".join(c.text or "" for c in chunks) == REPLY
    assert not [call for c in chunks for call in c.function_calls or []]  # the gateway's calls never reach the agent
    assert chunks[-1].candidates and chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    first, second, *rest = chats(up)
    cut = json.dumps(first.body["messages"])
    assert "ref ctx:" in cut and MARKER not in cut
    assert [t["function"]["name"] for t in first.body["tools"]] == ["run_shell_command", EXPAND_TOOL]
    n = len(first.body["messages"])
    assert second.body["messages"][:n] == first.body["messages"]  # the follow-up appends, all before unchanged
    call, result = second.body["messages"][n:n + 2]
    assert call["tool_calls"][0]["function"]["name"] == EXPAND_TOOL
    assert MARKER in result["content"] and result["tool_call_id"] == call["tool_calls"][0]["id"]
    http = chunks[0].sdk_http_response
    assert http and http.headers and int(http.headers["x-ctx-expansions"]) >= 1
    assert all(e.prompt_tokens is not None and e.prompt_tokens <= 6000 for e in [first, second, *rest])
