"""The scripted upstream's Messages and Responses doors, driven by the official SDKs."""
from __future__ import annotations

import anthropic
import openai
import pytest
from upstream import REPLY, ScriptedUpstream
from upstream_doors import THOUGHT, anthropic_input_tokens, responses_input_tokens, signature

ANTHROPIC_TOOLS = [{"name": "read_file", "description": "Read a file.",
                    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file.", "strict": False,
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
HISTORY = [
    {"role": "user", "content": "Read a.py"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should read it.", "signature": signature("I should read it.")},
        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "print(1)"}]},
        {"type": "text", "text": "What does it print?"}]},
]


@pytest.fixture
def claude(up: ScriptedUpstream) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=up.url, api_key="x", max_retries=0)


@pytest.fixture
def oai(up: ScriptedUpstream) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0)


def _events(raw: bytes) -> list[str]:
    return [line[len("event: "):] for line in raw.decode().splitlines() if line.startswith("event: ")]


# -- Anthropic Messages ---------------------------------------------------------------------
def test_messages_answers_ok_with_the_documented_count(claude: anthropic.Anthropic, up: ScriptedUpstream) -> None:
    msg = claude.messages.create(model="claude-x", max_tokens=64, system="Be brief.", messages=HISTORY,
                                 tools=ANTHROPIC_TOOLS)
    assert msg.content[0].type == "text" and msg.content[0].text == REPLY and msg.stop_reason == "end_turn"
    [entry] = up.log
    assert entry.door == "messages" and up.chats() == []
    key = entry.headers.get("x-api-key") or entry.headers.get("authorization", "").removeprefix("Bearer ")
    assert key == "x" and "anthropic-version" in entry.headers  # this SDK sends the key as a bearer token
    assert msg.usage.input_tokens == entry.prompt_tokens == anthropic_input_tokens(entry.body)
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.output_tokens == 1


def test_messages_stream_emits_anthropics_events(claude: anthropic.Anthropic, up: ScriptedUpstream) -> None:
    with claude.messages.stream(model="claude-summarizer", max_tokens=1000, messages=HISTORY) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text.startswith("1. Goal")
    assert final.usage.input_tokens == anthropic_input_tokens(up.log[0].body)
    events = _events(up.log[0].response)
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events.count("content_block_delta") > 1
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_messages_tool_call_and_thinking(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(model="claude-thinking-tools", max_tokens=64, messages=HISTORY,
                                 tools=ANTHROPIC_TOOLS)
    thinking, call = msg.content
    assert thinking.type == "thinking" and thinking.signature == signature(THOUGHT)
    assert call.type == "tool_use" and call.name == "read_file" and msg.stop_reason == "tool_use"
    with claude.messages.stream(model="claude-thinking-tools", max_tokens=64, messages=HISTORY,
                                tools=ANTHROPIC_TOOLS) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content][0] == thinking.model_dump()
    assert streamed.content[1].type == "tool_use" and streamed.content[1].input == call.input


def test_messages_max_tokens_truncates(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(model="summarizer", max_tokens=3, messages=[{"role": "user", "content": "go"}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_messages_overflow_and_errors(claude: anthropic.Anthropic, up: ScriptedUpstream) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="overflow", max_tokens=8, messages=HISTORY)
    used = anthropic_input_tokens(up.log[-1].body)
    assert caught.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"prompt is too long: {used} tokens > {used // 2} maximum"}}
    with pytest.raises(anthropic.InternalServerError) as failed:
        claude.messages.create(model="error-529", max_tokens=8, messages=HISTORY)
    assert failed.value.status_code == 529 and failed.value.body["error"]["type"] == "overloaded_error"


def test_count_tokens_counts_without_the_limit(claude: anthropic.Anthropic, up: ScriptedUpstream) -> None:
    up.limit = 10
    counted = claude.messages.count_tokens(model="claude-x", system="Be brief.", messages=HISTORY,
                                           tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == anthropic_input_tokens(up.log[0].body) > up.limit
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        claude.messages.create(model="claude-x", max_tokens=8, system="Be brief.", messages=HISTORY,
                               tools=ANTHROPIC_TOOLS)
    assert [e.door for e in up.log] == ["count_tokens", "messages"]
    assert up.log[1].prompt_tokens == counted.input_tokens


# -- OpenAI Responses -----------------------------------------------------------------------
RESPONSES_INPUT = [
    {"role": "user", "content": [{"type": "input_text", "text": "Read a.py"}]},
    {"type": "reasoning", "id": "rs_1", "encrypted_content": "opaque",
     "summary": [{"type": "summary_text", "text": "Read it first."}]},
    {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path":"a.py"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "print(1)"},
    {"role": "user", "content": "What does it print?"},
]


def test_responses_answers_ok_with_the_documented_count(oai: openai.OpenAI, up: ScriptedUpstream) -> None:
    resp = oai.responses.create(model="gpt-x", instructions="Be brief.", input=RESPONSES_INPUT,
                                tools=RESPONSES_TOOLS, store=False)  # type: ignore[arg-type]
    assert resp.output_text == REPLY and resp.status == "completed" and resp.id.startswith("resp_")
    [entry] = up.log
    assert entry.door == "responses" and up.chats() == []
    assert resp.usage is not None and resp.usage.input_tokens == responses_input_tokens(entry.body)
    assert responses_input_tokens({"input": "hi"}) == 3 + 4 + 1


def test_responses_stream_and_tool_call(oai: openai.OpenAI, up: ScriptedUpstream) -> None:
    with oai.responses.stream(model="gpt-x", input="hi") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == REPLY and kinds.count("response.output_text.delta") >= 2
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    call = oai.responses.create(model="gpt-tools", input=RESPONSES_INPUT, tools=RESPONSES_TOOLS)  # type: ignore[arg-type]
    assert call.output[0].type == "function_call" and call.output[0].name == "read_file"
    with oai.responses.stream(model="gpt-tools", input=RESPONSES_INPUT, tools=RESPONSES_TOOLS) as stream:  # type: ignore[arg-type]
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert streamed.output[0].type == "function_call" and streamed.output[0].arguments == call.output[0].arguments


def test_responses_overflow_and_unknown_previous_response(oai: openai.OpenAI, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model="overflow", input=RESPONSES_INPUT)  # type: ignore[arg-type]
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as missing:
        oai.responses.create(model="gpt-x", input="again", previous_response_id="resp_abc")
    assert missing.value.code == "previous_response_not_found"
