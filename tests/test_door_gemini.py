"""The Gemini door, driven by the official `google-genai` SDK over real sockets: a real
`ctxgate serve` in front of the scripted upstream (which speaks chat completions, so every
turn goes through the door's translation both ways); and the rendering rules on their own."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from ctxgate.proxy.doors.gemini_chat import chat_body
from servers import KEYS, Gateway, _model, launch, main_config, stop_all
from upstream import REPLY, ScriptedUpstream

KEY = KEYS["acme"]
TOOL = {"functionDeclarations": [{"name": "run_shell_command", "description": "Run a shell command.",
                                  "parametersJsonSchema": {"type": "object",
                                                           "properties": {"command": {"type": "string"}},
                                                           "required": ["command"]}}]}


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto")
    config["model_list"] += [_model(name, f"{upstream.url}/v1", max_input_tokens=100_000)
                             for name in ("fault-shape", "fault-brokensse", "fault-unterminated")]
    flaky = _model("flaky-503", f"{upstream.url}/v1", max_input_tokens=100_000)
    flaky["litellm_params"]["num_retries"] = 1
    config["model_list"].append(flaky)
    config["ctxgate"]["tenants"]["capped"] = {"api_keys": ["sk-capped"], "max_messages": 3, "max_content_parts": 4}
    gateway = launch("gemini", Path(tmp_path_factory.mktemp("gemini-door")), config).wait_ready()
    yield gateway
    stop_all([gateway])


def session() -> dict[str, str]:
    return {"X-Ctx-Session": f"gem-{uuid.uuid4().hex[:12]}"}


_CLIENTS: list[genai.Client] = []
"""The SDK closes its connection pool when a Client is collected: `client(gw).models...` would not outlive it."""


def client(gw: Gateway, headers: dict[str, str] | None = None, key: str = KEY, base: str = "") -> genai.Client:
    made = genai.Client(api_key=key, http_options=types.HttpOptions(base_url=base or gw.base,
                                                                     headers=session() if headers is None else headers))
    _CLIENTS.append(made)
    return made


def chats(up: ScriptedUpstream) -> list[Any]:
    return [r for r in up.log if r.door == "chat" and r.path.endswith("/chat/completions")]


def post(gw: Gateway, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(gw.base + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# -- the SDK against the door ---------------------------------------------------------------
def test_generate_content_answers_in_geminis_shape(gw: Gateway, up: ScriptedUpstream) -> None:
    headers = session()
    raw = client(gw, headers).models.generate_content(
        model="gpt-4o", contents="hello there",
        config=types.GenerateContentConfig(system_instruction="You are terse.", temperature=0.2,
                                           max_output_tokens=32))
    assert raw.text == REPLY
    assert raw.candidates and raw.candidates[0].finish_reason == types.FinishReason.STOP
    assert raw.usage_metadata and raw.usage_metadata.prompt_token_count and raw.usage_metadata.total_token_count
    [entry] = chats(up)
    assert entry.body["messages"] == [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "hello there"}]
    assert entry.body["temperature"] == 0.2 and entry.body["max_tokens"] == 32
    assert entry.headers["authorization"] != f"Bearer {KEY}"  # the route's own key, not the tenant's
    status, summary = gw.get(f"/v1/ctx/sessions/{headers['X-Ctx-Session']}", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and summary["turns"] == 1 and summary["answered_turns"] == 1


def test_a_function_call_and_its_response_round_trip(gw: Gateway, up: ScriptedUpstream) -> None:
    cli, headers = client(gw), session()
    asked = cli.models.generate_content(model="gpt-4o-tools", contents="list the files",
                                        config=types.GenerateContentConfig(tools=[types.Tool(**_snake(TOOL))]))
    assert asked.function_calls and asked.function_calls[0].name == "run_shell_command"
    call = asked.function_calls[0]
    assert call.args == {"path": "a.py"} and call.id
    assert chats(up)[-1].body["tools"][0]["function"]["name"] == "run_shell_command"
    contents = [types.Content(role="user", parts=[types.Part(text="list the files")]),
                asked.candidates[0].content,  # type: ignore[index]
                types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                    id=call.id, name=call.name, response={"output": "a.py b.py"}))])]
    cli = client(gw, headers)
    answer = cli.models.generate_content(model="gpt-4o", contents=contents)  # type: ignore[arg-type]
    assert answer.text == REPLY
    sent = chats(up)[-1].body["messages"]
    assert sent[1]["tool_calls"][0]["id"] == call.id and sent[1]["tool_calls"][0]["function"]["name"] == call.name
    assert sent[2] == {"role": "tool", "tool_call_id": call.id, "content": "a.py b.py"}


def _snake(tool: dict[str, Any]) -> dict[str, Any]:
    [fn] = tool["functionDeclarations"]
    return {"function_declarations": [{"name": fn["name"], "description": fn["description"],
                                       "parameters_json_schema": fn["parametersJsonSchema"]}]}


def test_generate_content_stream_over_sse(gw: Gateway, up: ScriptedUpstream) -> None:
    headers = session()
    chunks = list(client(gw, headers).models.generate_content_stream(model="gpt-4o", contents="stream please"))
    assert "".join(c.text or "" for c in chunks) == REPLY
    last = chunks[-1]
    assert last.candidates and last.candidates[0].finish_reason == types.FinishReason.STOP
    assert last.usage_metadata and last.usage_metadata.prompt_token_count
    assert chats(up)[-1].body["stream"] is True
    status, summary = gw.get(f"/v1/ctx/sessions/{headers['X-Ctx-Session']}", {"Authorization": f"Bearer {KEY}"})
    assert summary["answered_turns"] == 1


def test_streamed_function_call(gw: Gateway, up: ScriptedUpstream) -> None:
    config = types.GenerateContentConfig(tools=[types.Tool(**_snake(TOOL))])
    chunks = list(client(gw).models.generate_content_stream(model="gpt-4o-tools", contents="go", config=config))
    calls = [c for chunk in chunks for c in chunk.function_calls or []]
    assert [(c.name, c.args) for c in calls] == [("run_shell_command", {"path": "a.py"})]


def test_stream_without_alt_sse_is_one_json_array(gw: Gateway, up: ScriptedUpstream) -> None:
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    status, headers, raw = post(gw, "/v1beta/models/gpt-4o:streamGenerateContent", body,
                                {"x-goog-api-key": KEY, **session()})
    assert status == 200 and headers["X-Ctx-Levels"] == "none"
    chunks = json.loads(raw)
    assert isinstance(chunks, list) and chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    assert "".join(p.get("text", "") for c in chunks for p in c["candidates"][0]["content"]["parts"]) == REPLY


def test_count_tokens_and_the_key_in_the_query(gw: Gateway, up: ScriptedUpstream) -> None:
    counted = client(gw).models.count_tokens(model="gpt-4o", contents="how many tokens is this")
    assert counted.total_tokens and counted.total_tokens > 0
    body = {"contents": [{"role": "user", "parts": [{"text": "how many tokens is this"}]}]}
    status, headers, raw = post(gw, f"/v1beta/models/gpt-4o:countTokens?key={KEY}", body, session())
    assert status == 200 and json.loads(raw)["totalTokens"] == counted.total_tokens
    assert headers["X-Ctx-Count"] == "after-compaction"
    status, _, raw = post(gw, f"/s/{uuid.uuid4().hex[:8]}/v1beta/models/gpt-4o:countTokens",
                          {"generateContentRequest": body}, {"x-goog-api-key": KEY})
    assert status == 200 and json.loads(raw)["totalTokens"] == counted.total_tokens
    assert not chats(up)  # counting calls no model


def test_the_session_in_the_path(gw: Gateway, up: ScriptedUpstream) -> None:
    name = f"gem-path-{uuid.uuid4().hex[:8]}"
    cli = client(gw, {}, base=f"{gw.base}/s/{name}")
    assert cli.models.generate_content(model="gpt-4o", contents="hi").text == REPLY
    status, summary = gw.get(f"/v1/ctx/sessions/{name}", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and summary["turns"] == 1


# -- errors in Google's shape ---------------------------------------------------------------
@pytest.mark.parametrize("body, field", [
    ({}, "contents"),
    ({"contents": []}, "contents"),
    ({"contents": [{"role": "user"}]}, "contents.0.parts"),
    ({"contents": [{"role": "assistant", "parts": [{"text": "x"}]}]}, "contents.0.role"),
    ({"contents": [{"role": "user", "parts": [{"text": 5}]}]}, "contents.0.parts.0.text"),
    ({"contents": [{"role": "model", "parts": [{"functionCall": {"args": {}}}]}]},
     "contents.0.parts.0.functionCall.name"),
    ({"contents": [{"role": "user", "parts": [{"text": "x"}]}], "tools": [{"functionDeclarations": [{}]}]},
     "tools.0.functionDeclarations.0.name"),
])
def test_a_malformed_body_is_a_400_naming_the_field(gw: Gateway, up: ScriptedUpstream, body: Any,
                                                     field: str) -> None:
    status, _, raw = post(gw, "/v1beta/models/gpt-4o:generateContent", body, {"x-goog-api-key": KEY})
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == 400 and error["status"] == "INVALID_ARGUMENT"
    assert error["message"].startswith(field)
    assert not chats(up)  # nothing forwarded


def test_the_sdk_reads_a_bad_request_as_googles_error(gw: Gateway, up: ScriptedUpstream) -> None:
    contents = [types.Content(role="assistant", parts=[types.Part(text="hi")])]
    with pytest.raises(genai_errors.ClientError) as e:
        client(gw).models.generate_content(model="gpt-4o", contents=contents)  # type: ignore[arg-type]
    assert e.value.code == 400 and e.value.status == "INVALID_ARGUMENT"
    assert e.value.message and e.value.message.startswith("contents.0.role")
    assert not chats(up)


def test_not_json_and_a_wrong_key(gw: Gateway, up: ScriptedUpstream) -> None:
    status, _, raw = post(gw, "/v1beta/models/gpt-4o:generateContent", b"{not json", {"x-goog-api-key": KEY})
    assert status == 400 and json.loads(raw)["error"]["status"] == "INVALID_ARGUMENT"
    with pytest.raises(genai_errors.ClientError) as e:
        client(gw, key="sk-wrong").models.generate_content(model="gpt-4o", contents="hi")
    assert e.value.code == 401 and e.value.status == "UNAUTHENTICATED"
    assert not chats(up)


def test_an_upstream_error_keeps_its_status(gw: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(genai_errors.ClientError) as e:
        client(gw).models.generate_content(model="error-429", contents="hi")
    assert e.value.code == 429 and e.value.status == "RESOURCE_EXHAUSTED"


def test_unknown_paths_name_the_apis_served(gw: Gateway) -> None:
    status, _, raw = post(gw, "/v1/v1beta/models/gpt-4o:generateContent", {"contents": []}, {"x-goog-api-key": KEY})
    error = json.loads(raw)["error"]
    assert status == 404 and error["status"] == "NOT_FOUND" and "without /v1" in error["message"]
    assert "/v1/messages" in error["message"] and ":generateContent" in error["message"]
    status, _, raw = post(gw, "/v1/completions", {"prompt": "x"})
    error = json.loads(raw)["error"]
    assert status == 404 and error["code"] == "not_found" and "/v1/chat/completions" in error["message"]
    status, _, raw = post(gw, "/v1beta/models/gpt-4o:embedContent", {}, {"x-goog-api-key": KEY})
    assert status == 404 and json.loads(raw)["error"]["status"] == "NOT_FOUND"


# -- a long Gemini-CLI-shaped session, past the budget --------------------------------------
OUTPUT = "collected 12 items; test_core.py::test_app FAILED at line {i}; traceback follows " * 12
TASK = "Fix the failing test in pkg/core/app.py. Task id UNIQUE-TASK-3939."


def _step(i: int, signed: bool) -> list[dict[str, Any]]:
    call: dict[str, Any] = {"functionCall": {"name": "run_shell_command", "args": {"command": f"pytest -x  # {i}"}}}
    if signed:
        call["thoughtSignature"] = f"c2lnLXtp{i:04d}"  # opaque bytes, base64 on the wire
    return [{"role": "model", "parts": [{"text": f"Step {i}: checking the build."}, call]},
            {"role": "user", "parts": [{"functionResponse": {"name": "run_shell_command",
                                                             "response": {"output": OUTPUT.format(i=i)}}}]}]


def _valid_chat(messages: list[dict[str, Any]]) -> None:
    """What the chat upstream was sent keeps every tool result right after its call."""
    asked: set[str] = set()
    for m in messages:
        if m["role"] == "tool":
            assert m["tool_call_id"] in asked
        else:
            asked = {c["id"] for c in m.get("tool_calls") or []}


def test_long_session_past_the_budget_is_compacted(gw: Gateway, up: ScriptedUpstream) -> None:
    budget = 6000
    headers = {**session(), "X-Ctx-Budget": str(budget), "x-goog-api-key": KEY}
    body: dict[str, Any] = {"systemInstruction": {"parts": [{"text": "You are Gemini CLI, a coding agent."}]},
                            "tools": [TOOL], "contents": [{"role": "user", "parts": [{"text": TASK}]}]}
    for i in range(32):
        body["contents"] += _step(i, signed=i % 2 == 0)
    counts, levels = [], []
    for turn in range(6):
        body["contents"] += _step(32 + turn, signed=True)
        status, _, raw = post(gw, "/v1beta/models/gpt-4o:countTokens", body, headers)
        assert status == 200
        counts.append(json.loads(raw)["totalTokens"])
        status, answered, raw = post(gw, "/v1beta/models/gpt-4o:streamGenerateContent?alt=sse", body, headers)
        assert status == 200 and raw.rstrip().endswith(b"}") and b'"finishReason":"STOP"' in raw
        levels.append(answered["X-Ctx-Levels"])
        assert int(answered["X-Ctx-Tokens-Out"]) < int(answered["X-Ctx-Tokens-In"])
        entry = chats(up)[-1]
        assert entry.prompt_tokens <= budget
        sent = entry.body["messages"]
        _valid_chat(sent)
        assert sent[-1]["role"] == "tool" and sent[-1]["content"] == OUTPUT.format(i=32 + turn)  # the newest, as sent
        call = json.loads(sent[-2]["tool_calls"][0]["function"]["arguments"])
        assert call == {"command": f"pytest -x  # {32 + turn}"}
        assert "UNIQUE-TASK-3939" in json.dumps(sent)
    assert levels[0] != "none"  # the first turn over the budget compacted
    assert counts[0] < budget  # countTokens said what would be sent, after compaction


def test_the_sdk_sees_a_compacted_turn_answered(gw: Gateway, up: ScriptedUpstream) -> None:
    headers = {**session(), "X-Ctx-Budget": "6000"}
    contents: list[Any] = [{"role": "user", "parts": [{"text": TASK}]}]
    for i in range(40):
        contents += _step(i, signed=False)
    cli = client(gw, headers)
    counted = cli.models.count_tokens(model="gpt-4o", contents=contents)
    chunks = list(cli.models.generate_content_stream(model="gpt-4o", contents=contents))
    assert "".join(c.text or "" for c in chunks) == REPLY
    http = chunks[0].sdk_http_response
    assert http and http.headers and http.headers["x-ctx-levels"] != "none"
    assert int(http.headers["x-ctx-tokens-out"]) <= 6000 < int(http.headers["x-ctx-tokens-in"])
    assert counted.total_tokens and counted.total_tokens <= 6000 and chats(up)[-1].prompt_tokens <= 6000


def test_a_conversation_past_any_compaction_is_resource_exhausted(gw: Gateway, up: ScriptedUpstream) -> None:
    contents: list[Any] = [{"role": "user", "parts": [{"text": TASK}]}]
    for i in range(20):
        contents += _step(i, signed=False)
    with pytest.raises(genai_errors.ClientError) as e:  # this model refuses any prompt, however compacted
        client(gw).models.generate_content(model="overflow", contents=contents)
    assert e.value.code == 400 and e.value.status == "RESOURCE_EXHAUSTED"
    assert e.value.message and e.value.message.startswith("CONTEXT_EXHAUSTED")
    refused = chats(up)
    assert len(refused) >= 2 and refused[-1].prompt_tokens < refused[0].prompt_tokens  # compacted, then refused again


def test_a_turn_nested_past_the_limit_is_refused_in_the_contents_and_beside_them(gw: Gateway,
                                                                                  up: ScriptedUpstream) -> None:
    """The contents' nesting is checked by the door, in its new turns only; a field beside them
    as the body is read. Either way a 400 in Google's shape, nothing forwarded."""
    deep: Any = "x"
    for _ in range(300):
        deep = {"a": deep}
    turn = {"role": "model", "parts": [{"functionCall": {"name": "f", "args": deep}}]}
    for body in ({"contents": [{"role": "user", "parts": [{"text": "hi"}]}, turn]},
                 {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": deep}):
        status, _, raw = post(gw, "/v1beta/models/gpt-4o:generateContent", body, {"x-goog-api-key": KEY})
        error = json.loads(raw)["error"]
        assert status == 400 and error["status"] == "INVALID_ARGUMENT" and "nests" in error["message"], raw
    assert not chats(up)


def test_a_steady_turn_checks_its_new_turns(gw: Gateway, up: ScriptedUpstream) -> None:
    """What the session's last request had was checked then; a new turn is checked, and named by
    its place in the whole conversation."""
    headers = {**session(), "x-goog-api-key": KEY}
    body: dict[str, Any] = {"contents": [{"role": "user", "parts": [{"text": "first"}]},
                                         {"role": "model", "parts": [{"text": "ok"}]},
                                         {"role": "user", "parts": [{"text": "second"}]}]}
    assert post(gw, "/v1beta/models/gpt-4o:generateContent", body, headers)[0] == 200
    body["contents"] += [{"role": "model", "parts": [{"text": "ok"}]}, {"role": "user", "parts": [{"text": 7}]}]
    status, _, raw = post(gw, "/v1beta/models/gpt-4o:generateContent", body, headers)
    assert status == 400 and json.loads(raw)["error"]["message"].startswith("contents.4.parts.0.text")
    body["contents"][0]["parts"][0]["text"] = 8  # a changed history is not the one checked: checked again
    body["contents"][4]["parts"][0]["text"] = "third"
    status, _, raw = post(gw, "/v1beta/models/gpt-4o:generateContent", body, headers)
    assert status == 400 and json.loads(raw)["error"]["message"].startswith("contents.0.parts.0.text")
    assert len(chats(up)) == 1


def test_a_chat_routes_body_arrives_whole_with_its_length(gw: Gateway, up: ScriptedUpstream) -> None:
    """A steady turn's chat body is sent as the pieces the session's turns made: the upstream
    is told its exact length (no chunked encoding) and reads the chat body made afresh."""
    headers = {**session(), "x-goog-api-key": KEY}
    body: dict[str, Any] = {"contents": [{"role": "user", "parts": [{"text": "first"}]}], "tools": [TOOL],
                            "systemInstruction": {"parts": [{"text": "Be brief."}]}}
    before = len(chats(up))
    for turn in range(3):
        assert post(gw, "/v1beta/models/gpt-4o:generateContent", body, headers)[0] == 200
        body["contents"] += [{"role": "model", "parts": [{"functionCall": {"name": "run_shell_command",
                                                                           "args": {"command": f"ls {turn}"}}}]},
                             {"role": "user", "parts": [{"functionResponse": {"name": "run_shell_command",
                                                                              "response": {"output": f"f{turn}"}}}]}]
    sent = chats(up)[before:]
    assert len(sent) == 3
    for turn, got in enumerate(sent):
        assert got.headers["content-length"] == str(len(got.raw)) and "transfer-encoding" not in got.headers
        assert got.body == chat_body({**body, "contents": body["contents"][:1 + 2 * turn]}, "gpt-4o", False)


def test_a_retried_chat_body_in_pieces_is_sent_again_whole(gw: Gateway, up: ScriptedUpstream) -> None:
    """A steady turn's chat body (its pieces) that the upstream refused once is sent again, the
    same bytes with the same length (`flaky-503` fails the first request with given bytes)."""
    headers = {**session(), "x-goog-api-key": KEY}
    body: dict[str, Any] = {"contents": [{"role": "user", "parts": [{"text": "first"}]}]}
    assert post(gw, "/v1beta/models/flaky-503:generateContent", body, headers)[0] == 200
    body["contents"] += [{"role": "model", "parts": [{"text": "ok"}]}, {"role": "user", "parts": [{"text": "next"}]}]
    before = len(chats(up))
    assert post(gw, "/v1beta/models/flaky-503:generateContent", body, headers)[0] == 200
    first, again = chats(up)[before:]
    assert first.raw == again.raw and again.headers["content-length"] == str(len(again.raw))
    assert again.body == chat_body(body, "flaky-503", False)


def test_a_steady_turn_whose_history_was_edited_is_read_afresh(gw: Gateway, up: ScriptedUpstream) -> None:
    """A steady turn parses and reads only its new turns (its body past 16 KiB resends the last
    one's bytes: `ResentBodies`); a client that changed an earlier turn (or its system
    instruction) is sent what it sent now, nothing of the earlier reading."""
    headers = {**session(), "x-goog-api-key": KEY}
    args = {"command": "ls", "why": "x" * 20_000}
    call = {"role": "model", "parts": [{"functionCall": {"name": "run_shell_command", "args": args}}]}
    answer = {"role": "user", "parts": [{"functionResponse": {"name": "run_shell_command",
                                                              "response": {"output": "a.txt"}}}]}
    body: dict[str, Any] = {"systemInstruction": {"parts": [{"text": "Be brief."}]}, "tools": [TOOL],
                            "contents": [{"role": "user", "parts": [{"text": "list the files"}]}, call]}
    sent = []
    for contents in ([answer], [{"role": "model", "parts": [{"text": "a.txt"}]},
                                {"role": "user", "parts": [{"text": "thanks"}]}]):
        body["contents"] += contents
        assert post(gw, "/v1beta/models/gpt-4o:generateContent", body, headers)[0] == 200
        sent.append(chats(up)[-1].body["messages"])
    assert sent[1][:len(sent[0])] == sent[0] and sent[1][3] == {"role": "tool", "tool_call_id": "gc1_0",
                                                                 "content": "a.txt"}
    body["contents"][0]["parts"][0]["text"] = "list the files, sorted"
    body["contents"][2]["parts"][0]["functionResponse"]["response"] = {"output": "b.txt"}
    body["contents"] += [{"role": "model", "parts": [{"text": "b.txt"}]}, {"role": "user", "parts": [{"text": "ok"}]}]
    assert post(gw, "/v1beta/models/gpt-4o:generateContent", body, headers)[0] == 200
    edited = chats(up)[-1].body["messages"]
    assert edited[1] == {"role": "user", "content": "list the files, sorted"} and edited[3]["content"] == "b.txt"
    body["systemInstruction"] = {"parts": [{"text": "Be thorough."}]}
    body["contents"] += [{"role": "model", "parts": [{"text": "fine"}]}, {"role": "user", "parts": [{"text": "go"}]}]
    assert post(gw, "/v1beta/models/gpt-4o:generateContent", body, headers)[0] == 200
    last = chats(up)[-1].body["messages"]
    assert last[0] == {"role": "system", "content": "Be thorough."} and last[1:len(edited)] == edited[1:]
    assert [m["role"] for m in last[-2:]] == ["assistant", "user"] and last[-1]["content"] == "go"


def test_fields_resent_as_they_were_are_not_checked_again_changed_ones_are(gw: Gateway,
                                                                          up: ScriptedUpstream) -> None:
    """A steady turn that resends the last one's declarations byte for byte gets its objects
    back (`ResentBodies`), checked and made chat tools last turn; declarations or settings
    that changed are checked and sent anew."""
    headers = {**session(), "x-goog-api-key": KEY}
    pad = {"role": "model", "parts": [{"functionCall": {"name": "run_shell_command",
                                                        "args": {"command": "ls", "why": "x" * 20_000}}}]}
    body: dict[str, Any] = {"contents": [{"role": "user", "parts": [{"text": "list the files"}]}, pad],
                            "tools": [TOOL], "generationConfig": {"temperature": 0.5}}

    def turn(text: str) -> tuple[int, Any]:
        body["contents"] += [{"role": "user", "parts": [{"text": text}]}]
        status, _, raw = post(gw, "/v1beta/models/gpt-4o:generateContent", body, headers)
        body["contents"] += [{"role": "model", "parts": [{"text": "ok"}]}]
        return status, json.loads(raw)

    for text in ("one", "two"):
        assert turn(text)[0] == 200
        assert [t["function"]["name"] for t in chats(up)[-1].body["tools"]] == ["run_shell_command"]
        assert chats(up)[-1].body["temperature"] == 0.5
    second = {"name": "read_file", "description": "Read a file.", "parametersJsonSchema": {"type": "object"}}
    body["tools"] = [{"functionDeclarations": [*TOOL["functionDeclarations"], second]}]
    body["generationConfig"] = {"temperature": 0.1}
    assert turn("three")[0] == 200
    assert [t["function"]["name"] for t in chats(up)[-1].body["tools"]] == ["run_shell_command", "read_file"]
    assert chats(up)[-1].body["temperature"] == 0.1
    forwarded = len(chats(up))
    body["tools"] = [{"functionDeclarations": [*TOOL["functionDeclarations"], {"description": "no name"}]}]
    status, error = turn("four")
    assert status == 400 and error["error"]["message"].startswith("tools.0.functionDeclarations.1.name"), error
    body["tools"] = [TOOL]
    body["generationConfig"] = 5
    status, error = turn("five")
    assert status == 400 and error["error"]["message"].startswith("generationConfig"), error
    assert len(chats(up)) == forwarded


def test_a_broken_upstream_reply_is_an_error_in_googles_shape(gw: Gateway, up: ScriptedUpstream) -> None:
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    headers = {**session(), "x-goog-api-key": KEY}
    status, _, raw = post(gw, "/v1beta/models/fault-shape:generateContent", body, headers)
    assert status == 502 and json.loads(raw)["error"]["status"] == "UNAVAILABLE"
    status, _, raw = post(gw, "/v1beta/models/fault-brokensse:streamGenerateContent?alt=sse", body, headers)
    last = [line for line in raw.split(b"\n") if line.startswith(b"data:")][-1]
    assert status == 200 and json.loads(last[5:])["error"]["status"] == "UNAVAILABLE"  # after the headers went
    status, _, raw = post(gw, "/v1beta/models/fault-unterminated:streamGenerateContent", body, headers)
    elements = json.loads(raw)  # still one JSON array, its last element the error
    assert status == 200 and elements[-1]["error"]["code"] == 502 and "before its last event" in raw.decode()
    status, summary = gw.get(f"/v1/ctx/sessions/{headers['X-Ctx-Session']}", {"Authorization": f"Bearer {KEY}"})
    assert summary["answered_turns"] == 0  # none of them settled as an answer


def test_a_tenants_caps_count_turns_and_parts(gw: Gateway, up: ScriptedUpstream) -> None:
    turn = {"role": "user", "parts": [{"text": "a"}, {"text": "b"}]}
    status, _, raw = post(gw, "/v1beta/models/gpt-4o:generateContent", {"contents": [turn] * 4},
                          {"x-goog-api-key": "sk-capped"})
    assert status == 400 and "max_messages" in json.loads(raw)["error"]["message"]
    body = {"systemInstruction": {"parts": [{"text": "s"}]}, "contents": [turn, turn]}
    status, _, raw = post(gw, "/v1beta/models/gpt-4o:countTokens", body, {"x-goog-api-key": "sk-capped"})
    assert status == 400 and "max_content_parts" in json.loads(raw)["error"]["message"]
    assert not chats(up)


def test_a_large_body_is_read_off_the_event_loop_alike(gw: Gateway, up: ScriptedUpstream) -> None:
    """A body past HeavyWork's size is checked and read in a thread: the same answers."""
    big = [{"role": "user", "parts": [{"text": "x" * 3500}]}, {"role": "model", "parts": [{"text": "ok"}]}] * 80
    body = {"contents": [*big, {"role": "user", "parts": [{"text": "last"}]}]}
    assert len(json.dumps(body)) > 256 * 1024
    status, headers, raw = post(gw, "/v1beta/models/gpt-4o:generateContent", body, {"x-goog-api-key": KEY})
    assert status == 200 and json.loads(raw)["candidates"][0]["content"]["parts"] == [{"text": REPLY}]
    body["contents"][-1]["parts"][0]["text"] = 5
    status, _, raw = post(gw, "/v1beta/models/gpt-4o:generateContent", body, {"x-goog-api-key": KEY})
    assert status == 400 and json.loads(raw)["error"]["message"].startswith("contents.160.parts.0.text")
