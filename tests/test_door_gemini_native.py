"""The Gemini door forwarding natively to `gemini/` routes (the scripted upstream answers as
Google's API does, and refuses what it would refuse), driven by the `google-genai` SDK."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from servers import KEYS, UPSTREAM_KEY, Gateway, launch, main_config, stop_all
from test_door_gemini import OUTPUT, TASK, TOOL, _step, post
from upstream import REPLY, Received, ScriptedUpstream
from upstream_gemini import SIGNATURE, invalid

KEY = KEYS["acme"]
_CLIENTS: list[genai.Client] = []


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto")
    config["model_list"] += [{"model_name": name, "model_info": {"max_input_tokens": 100_000}, "litellm_params": {
        "model": f"gemini/{name}", "api_base": upstream.url, "api_key": UPSTREAM_KEY}}
        for name in ("gemini-x", "gemini-tools", "gemini-overflow")]
    gateway = launch("gemini-native", Path(tmp_path_factory.mktemp("gemini-native")), config).wait_ready()
    yield gateway
    stop_all([gateway])


def client(gw: Gateway, headers: dict[str, str] | None = None, **kw: Any) -> genai.Client:
    made = genai.Client(api_key=KEY, http_options=types.HttpOptions(
        base_url=gw.base, api_version="v1beta", headers=headers or {"X-Ctx-Session": f"gn-{uuid.uuid4().hex[:12]}"},
        **kw))
    _CLIENTS.append(made)
    return made


def sent(up: ScriptedUpstream) -> list[Received]:
    return [r for r in up.log if r.door == "gemini"]


def test_an_unchanged_request_reaches_google_as_the_clients_bytes(gw: Gateway, up: ScriptedUpstream) -> None:
    config = types.GenerateContentConfig(system_instruction="You are terse.",
                                         thinking_config=types.ThinkingConfig(thinking_budget=0))
    reply = client(gw).models.generate_content(model="gemini-x", contents="hi", config=config)
    assert reply.text == REPLY and reply.usage_metadata and reply.usage_metadata.prompt_token_count
    [entry] = sent(up)
    assert entry.path == "/v1beta/models/gemini-x:generateContent"
    assert entry.headers["x-goog-api-key"] == UPSTREAM_KEY
    mine = b'{"contents": [{"role": "user", "parts": [{"text": "hi"}]}],  "futureField": [1]}'
    status, _, raw = post(gw, "/v1beta/models/gemini-x:generateContent", mine, {"x-goog-api-key": KEY})
    assert status == 200 and sent(up)[-1].raw == mine  # nothing compacted: Google gets the client's bytes


def test_streams_sse_and_json_array(gw: Gateway, up: ScriptedUpstream) -> None:
    chunks = list(client(gw).models.generate_content_stream(model="gemini-x", contents="hi"))
    assert "".join(c.text or "" for c in chunks) == REPLY
    assert sent(up)[-1].path == "/v1beta/models/gemini-x:streamGenerateContent?alt=sse"
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    status, _, raw = post(gw, "/v1beta/models/gemini-x:streamGenerateContent", body, {"x-goog-api-key": KEY})
    assert status == 200 and json.loads(raw)[-1]["candidates"][0]["finishReason"] == "STOP"


def test_a_signed_function_call_comes_back_as_sent(gw: Gateway, up: ScriptedUpstream) -> None:
    config = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[types.FunctionDeclaration(
        name="run_shell_command", parameters_json_schema={"type": "object"})])])
    reply = client(gw).models.generate_content(model="gemini-tools", contents="go", config=config)
    part = reply.candidates[0].content.parts[0]  # type: ignore[index, union-attr]
    assert part.function_call and part.function_call.name == "run_shell_command"
    assert part.thought_signature and part.thought_signature.hex()  # bytes, as the SDK decodes them
    assert json.loads(sent(up)[-1].response)["candidates"][0]["content"]["parts"][0]["thoughtSignature"] == SIGNATURE


def test_a_long_session_stays_valid_for_gemini_and_keeps_signed_turns(gw: Gateway, up: ScriptedUpstream) -> None:
    budget = 6000
    headers = {"X-Ctx-Session": f"gn-{uuid.uuid4().hex[:12]}", "X-Ctx-Budget": str(budget), "x-goog-api-key": KEY}
    body: dict[str, Any] = {"systemInstruction": {"parts": [{"text": "You are Gemini CLI."}]}, "tools": [TOOL],
                            "contents": [{"role": "user", "parts": [{"text": TASK}]}]}
    for i in range(32):
        body["contents"] += _step(i, signed=i % 3 == 0)
    sizes = []
    for turn in range(6):
        body["contents"] += _step(32 + turn, signed=True)
        status, answered, raw = post(gw, "/v1beta/models/gemini-x:streamGenerateContent?alt=sse", body, headers)
        assert status == 200, raw
        entry = sent(up)[-1]
        forwarded = entry.body
        assert invalid(forwarded) is None and entry.prompt_tokens is not None and entry.prompt_tokens <= budget
        assert forwarded["contents"][-2:] == body["contents"][-2:]  # the newest step, as sent
        assert "UNIQUE-TASK-3939" in json.dumps(forwarded)
        signed = [t for t in forwarded["contents"] if any("thoughtSignature" in p for p in t["parts"])]
        assert signed and all(t in body["contents"] for t in signed)  # byte for byte, or not at all
        sizes.append(entry.prompt_tokens)
        assert int(answered["X-Ctx-Tokens-Out"]) < int(answered["X-Ctx-Tokens-In"])
    assert OUTPUT.format(i=0) not in json.dumps(sent(up)[-1].body)  # the oldest output was compacted away


def test_too_long_for_google_is_compacted_then_resource_exhausted(gw: Gateway, up: ScriptedUpstream) -> None:
    contents: list[Any] = [{"role": "user", "parts": [{"text": TASK}]}]
    for i in range(20):
        contents += _step(i, signed=False)
    with pytest.raises(genai_errors.ClientError) as e:
        client(gw).models.generate_content(model="gemini-overflow", contents=contents)
    assert e.value.code == 400 and e.value.status == "RESOURCE_EXHAUSTED"
    first, second = sent(up)
    assert second.prompt_tokens is not None and first.prompt_tokens is not None
    assert second.prompt_tokens < first.prompt_tokens and invalid(second.body) is None
