"""The official openai SDK against ctxgate, on both forwarding paths: below the
compaction threshold ctxgate is transparent both ways and adds only X-Ctx-* headers."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai

from clients import CTX_HEADERS, KEYS, MESSAGES, TOOLS, async_client, client, reference_tokens
from servers import Gateway
from upstream import REPLY, ScriptedUpstream

SENT_PARAMS: dict[str, Any] = {"temperature": 0.3, "max_tokens": 7, "top_p": 0.9, "seed": 11, "user": "u-1",
                               "presence_penalty": 0.1, "frequency_penalty": 0.2, "logprobs": False}
EXTRA: dict[str, Any] = {"custom_flag": {"nested": [1, 2, {"deep": None}]}, "metadata_tag": "exp-7"}


def _core(reply: dict[str, Any]) -> dict[str, Any]:
    """What of a chat.completion must survive any re-serialisation."""
    return {"id": reply["id"], "object": reply["object"], "created": reply["created"],
            "choices": [{"index": c["index"], "finish_reason": c["finish_reason"],
                         "content": c["message"].get("content"), "role": c["message"]["role"]}
                        for c in reply["choices"]],
            "usage": {k: reply["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}


def _forwarded(up: ScriptedUpstream) -> dict[str, Any]:
    chats = up.chats()
    assert len(chats) == 1, [c.body for c in chats]
    return chats[0].body


def test_sync_reply_is_the_upstreams(gateway: Gateway, up: ScriptedUpstream) -> None:
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MESSAGES, extra_headers={"X-Ctx-Session": "sdk-sync"}, **SENT_PARAMS)
    reply = raw.parse()
    answered = json.loads(up.chats()[-1].response)
    assert reply.id == answered["id"] and reply.id.startswith("chatcmpl-up-")
    assert reply.choices[0].message.content == REPLY
    assert reply.usage is not None and reply.usage.prompt_tokens == up.chats()[-1].prompt_tokens
    assert _core(json.loads(raw.http_response.content)) == _core(answered)
    if gateway.name == "auto":
        assert raw.http_response.content == up.chats()[-1].response  # byte for byte


def test_upstream_receives_what_the_client_sent(gateway: Gateway, up: ScriptedUpstream) -> None:
    client(gateway).chat.completions.create(model="gpt-4o", messages=MESSAGES, extra_body=EXTRA, **SENT_PARAMS)
    got = _forwarded(up)
    assert got["model"] == "gpt-4o"  # litellm_params' model without its provider prefix
    assert got["messages"] == MESSAGES
    for key, value in {**SENT_PARAMS, **EXTRA}.items():
        assert got.get(key) == value, (key, got.get(key))
    if gateway.name == "auto":
        assert got == {"model": "gpt-4o", "messages": MESSAGES, **SENT_PARAMS, **EXTRA}


def test_an_unchanged_request_reaches_the_upstream_as_the_clients_bytes(gateway: Gateway, up: ScriptedUpstream) -> None:
    """Nothing compacted, nothing injected: the direct path forwards the bytes the client sent
    (no re-serialising; the provider's prompt cache sees exactly what the client would have
    sent). Through litellm the body is rebuilt, and only its meaning is the same."""
    sent: list[httpx.Request] = []
    sdk = openai.OpenAI(base_url=gateway.url, api_key=KEYS["acme"], max_retries=0,
                        http_client=httpx.Client(event_hooks={"request": [sent.append]}))
    sdk.chat.completions.create(model="gpt-4o", messages=MESSAGES, temperature=0.25, user="bytes-test")
    [received] = up.chats()
    if gateway.name == "auto":
        assert received.raw == sent[0].read()
    assert received.body["messages"] == MESSAGES and received.body["temperature"] == 0.25


def test_ctx_headers_below_threshold(gateway: Gateway, up: ScriptedUpstream) -> None:
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="gpt-4o", messages=MESSAGES, extra_headers={"X-Ctx-Session": "sdk-headers"})
    h = raw.headers
    assert all(name in h for name in CTX_HEADERS), dict(h)
    assert h["x-ctx-session"] == "sdk-headers"
    assert int(h["x-ctx-tokens-in"]) == reference_tokens(MESSAGES) == int(h["x-ctx-tokens-out"])
    assert h["x-ctx-levels"] == "none"
    assert float(h["x-ctx-overhead-ms"]) >= 0.0
    assert h["x-ctx-tokenizer"] == "tiktoken:o200k_base"
    sent_upstream = up.chats()[-1].headers
    assert not any(k.startswith("x-ctx-") for k in sent_upstream), sent_upstream


def test_streaming_with_usage(gateway: Gateway, up: ScriptedUpstream) -> None:
    with client(gateway).chat.completions.with_streaming_response.create(
            model="gpt-4o", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Ctx-Session": "sdk-stream"}) as resp:
        assert resp.headers["x-ctx-session"] == "sdk-stream"
        assert resp.headers["x-ctx-levels"] == "none"
        assert int(resp.headers["x-ctx-tokens-in"]) == reference_tokens(MESSAGES)
        chunks = list(resp.parse())
    assert len(chunks) >= 3
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == up.chats()[-1].prompt_tokens
    assert all(c.id == chunks[0].id for c in chunks)
    assert _forwarded(up)["stream_options"] == {"include_usage": True}


def test_stream_bytes_pass_through_on_auto(gateway: Gateway, up: ScriptedUpstream) -> None:
    body = {"model": "gpt-4o", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", gateway.url + "/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEYS['acme']}"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        received = b"".join(resp.iter_raw())
    assert received.rstrip().endswith(b"data: [DONE]")
    if gateway.name == "auto":
        assert received == up.chats()[-1].response
    else:  # litellm re-frames the stream: the same chunks, by content
        frames = [json.loads(line[6:]) for line in received.split(b"\n") if line.startswith(b"data: {")]
        assert frames[-1]["usage"]["prompt_tokens"] == up.chats()[-1].prompt_tokens
        assert "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"]) == REPLY


def test_without_stream_options_there_is_no_usage_chunk(gateway: Gateway, up: ScriptedUpstream) -> None:
    chunks = list(client(gateway).chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert all(c.choices for c in chunks)


async def test_async_client_concurrent_and_streaming(gateway: Gateway, up: ScriptedUpstream) -> None:
    async with async_client(gateway) as cli:
        replies = await asyncio.gather(*(cli.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": f"question {i}"}]) for i in range(8)))
        assert {r.choices[0].message.content for r in replies} == {REPLY}
        assert len({r.id for r in replies}) == 8
        stream = await cli.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True,
                                                   stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == reference_tokens(MESSAGES)
    assert len(up.chats()) == 9


def test_tool_calls_round_trip(gateway: Gateway, up: ScriptedUpstream) -> None:
    cli = client(gateway)
    first = cli.chat.completions.create(model="gpt-4o-tools", messages=MESSAGES, tools=TOOLS, tool_choice="auto")
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "a.py"}
    got = up.chats()[-1].body
    assert got["tools"] == TOOLS and got["tool_choice"] == "auto"
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "read_file", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "print('hello')"}]
    second = cli.chat.completions.create(model="gpt-4o", messages=history, tools=TOOLS)
    assert second.choices[0].message.content == REPLY
    forwarded = up.chats()[-1].body["messages"]
    assert forwarded[:4] == MESSAGES and forwarded[-1] == history[-1]
    assert forwarded[4]["tool_calls"] == history[4]["tool_calls"]


def test_streamed_tool_call(gateway: Gateway, up: ScriptedUpstream) -> None:
    chunks = list(client(gateway).chat.completions.create(model="gpt-4o-tools", messages=MESSAGES, tools=TOOLS,
                                                          stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "read_file" and deltas[0].id == "call_up_0"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"path": "a.py"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_n_choices(gateway: Gateway, up: ScriptedUpstream) -> None:
    reply = client(gateway).chat.completions.create(model="gpt-4o", messages=MESSAGES, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [REPLY, f"{REPLY} 1", f"{REPLY} 2"]
    assert _forwarded(up)["n"] == 3


def test_stop_sequences(gateway: Gateway, up: ScriptedUpstream) -> None:
    reply = client(gateway).chat.completions.create(model="gpt-4o", messages=MESSAGES, stop=["k", "END"])
    assert reply.choices[0].message.content == REPLY[: REPLY.index("k")]
    assert _forwarded(up)["stop"] == ["k", "END"]


def test_response_format(gateway: Gateway, up: ScriptedUpstream) -> None:
    cli = client(gateway)
    reply = cli.chat.completions.create(model="gpt-4o", messages=MESSAGES, response_format={"type": "json_object"})
    assert json.loads(reply.choices[0].message.content or "") == {"ok": True}
    assert up.chats()[-1].body["response_format"] == {"type": "json_object"}
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}}
    reply = cli.chat.completions.create(model="gpt-4o", messages=MESSAGES, response_format=schema)  # type: ignore[arg-type]
    assert json.loads(reply.choices[0].message.content or "") == {"ok": True}
    assert up.chats()[-1].body["response_format"] == schema


def test_content_parts_pass_through(gateway: Gateway, up: ScriptedUpstream) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in the file?"},
                                              {"type": "text", "text": "Answer briefly."}]}]
    raw = client(gateway).chat.completions.with_raw_response.create(model="gpt-4o", messages=messages)
    assert raw.parse().choices[0].message.content == REPLY
    assert up.chats()[-1].body["messages"] == messages
    assert int(raw.headers["x-ctx-tokens-in"]) == reference_tokens(messages)
