"""The Anthropic Messages door, driven by the official `anthropic` SDK over real sockets: a
real `ctxgate serve` in front of the scripted upstream, natively to `anthropic/...` routes and
through litellm's adapter to an OpenAI one; and the rendering rules on their own."""
from __future__ import annotations

import asyncio
import copy
import json
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import httpx2
import pytest

from ctxgate.pipeline.notes import NOTICE, SNIP, TAG, context_note, notice_message, tag_legacy
from ctxgate.proxy.doors.messages_model import COMPACTED_OPENING, CONTEXT_ACK, conversation_of, render
from ctxgate.proxy.engine.memory_turn import block_message
from ctxgate.proxy.doors.messages_replies import MessagesStream, reply_facts
from servers import UPSTREAM_KEY, Gateway, launch, main_config, stop_all
from upstream import REPLY, ScriptedUpstream
from upstream_doors import THOUGHT, anthropic_input_tokens, signature

CLAUDE_KEY = "sk-claude"
TOOLS = [{"name": "bash", "description": "Run a shell command.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]
CLAUDE_ROUTES = {"claude-x": "claude-x", "claude-tools": "claude-tools", "claude-thinking": "claude-thinking",
                 "claude-529": "error-529", "claude-429": "error-429", "claude-overflow": "overflow",
                 "claude-slow": "slow"}


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto")
    config["model_list"] += [{"model_name": name, "model_info": {"max_input_tokens": 100_000}, "litellm_params": {
        "model": f"anthropic/{model}", "api_base": upstream.url, "api_key": UPSTREAM_KEY}}
        for name, model in CLAUDE_ROUTES.items()]
    config["model_list"].append({"model_name": "claude-v1", "litellm_params": {
        "model": "anthropic/claude-x", "api_base": f"{upstream.url}/v1", "api_key": UPSTREAM_KEY}})
    config["model_list"].append({"model_name": "claude-v1-adapter", "litellm_params": {
        "model": "openai/claude-x", "api_base": f"{upstream.url}/v1", "api_key": UPSTREAM_KEY}})
    config["ctxgate"]["upstream_timeout_s"] = 1.5  # a stream stalled longer breaks off (the slow model stalls 3 s)
    config["ctxgate"]["tenants"]["claude"] = {"api_keys": [CLAUDE_KEY], "allow_overrides": ["budget"]}
    gateway = launch("messages", Path(tmp_path_factory.mktemp("messages-door")), config).wait_ready()
    yield gateway
    stop_all([gateway])


def session() -> dict[str, str]:
    return {"X-Ctx-Session": f"msg-{uuid.uuid4().hex[:12]}"}


def client(gw: Gateway, key: str = CLAUDE_KEY, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.base, api_key=key, max_retries=0, **kw)


def sent(up: ScriptedUpstream, door: str = "messages") -> list[Any]:
    return [r for r in up.log if r.door == door]


def turns_of(gw: Gateway, session_id: str) -> Any:
    status, summary = gw.get(f"/v1/ctx/sessions/{session_id}", {"x-api-key": CLAUDE_KEY})
    return summary["turns"] if status == 200 else None


# -- the door over real sockets -------------------------------------------------------------
def test_unchanged_request_reaches_anthropic_as_the_clients_bytes(gw: Gateway, up: ScriptedUpstream) -> None:
    seen: list[Any] = []
    http = httpx2.Client(event_hooks={"request": [seen.append]})
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    msg = client(gw, http_client=http).messages.create(
        model="claude-x", max_tokens=16, system=system, messages=[{"role": "user", "content": "hi"}],
        metadata={"user_id": "u-1"}, extra_headers={**session(), "anthropic-beta": "prompt-caching-2024-07-31"},
        extra_body={"temperature": 0.5, "top_k": 3, "future_field": [1]})
    assert msg.content[0].type == "text" and msg.content[0].text == REPLY
    [entry] = sent(up)
    assert entry.raw == seen[0].read()  # nothing compacted: the upstream got what the client sent, byte for byte
    assert entry.headers["x-api-key"] == UPSTREAM_KEY and entry.headers["anthropic-beta"] == "prompt-caching-2024-07-31"
    assert entry.headers["anthropic-version"] == seen[0].headers["anthropic-version"]
    assert "authorization" not in entry.headers
    assert msg.usage.input_tokens == anthropic_input_tokens(entry.body)


def test_api_base_with_v1_and_the_async_client(gw: Gateway, up: ScriptedUpstream) -> None:
    async def ask() -> Any:
        async with anthropic.AsyncAnthropic(base_url=gw.base, api_key=CLAUDE_KEY, max_retries=0) as cli:
            return await cli.messages.create(model="claude-v1", max_tokens=16, messages=[
                {"role": "user", "content": "hi"}], extra_headers=session())
    assert asyncio.run(ask()).content[0].text == REPLY
    assert [e.path for e in sent(up)] == ["/v1/messages"]


def test_stream_relays_anthropics_events_and_logs_the_turn(gw: Gateway, up: ScriptedUpstream) -> None:
    headers = session()
    with client(gw).messages.stream(model="claude-x", max_tokens=16, messages=[{"role": "user", "content": "hi"}],
                                    extra_headers=headers) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == REPLY and final.stop_reason == "end_turn"
    assert final.usage.input_tokens == sent(up)[0].prompt_tokens
    assert turns_of(gw, headers["X-Ctx-Session"]) == 1


def test_a_stream_that_stalls_ends_with_an_error_event(gw: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(anthropic.APIStatusError) as e:
        with client(gw).messages.stream(model="claude-slow", max_tokens=16,
                                        messages=[{"role": "user", "content": "hi"}]) as stream:
            stream.get_final_message()
    assert e.value.body == {"type": "error", "error": {"type": "timeout_error",
                                                       "message": "upstream stalled mid-stream"}}


def test_tool_use_round_trip(gw: Gateway, up: ScriptedUpstream) -> None:
    cli, headers = client(gw), session()
    history: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    first = cli.messages.create(model="claude-tools", max_tokens=64, tools=TOOLS,  # type: ignore[arg-type]
                                messages=history, extra_headers=headers)
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and call.name == "bash"
    history += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "a.py"}]}]
    second = cli.messages.create(model="claude-x", max_tokens=64, tools=TOOLS,  # type: ignore[arg-type]
                                 messages=history, extra_headers=headers)  # type: ignore[arg-type]
    assert second.content[0].text == REPLY  # type: ignore[union-attr]
    assert sent(up)[-1].body["messages"] == history
    assert turns_of(gw, headers["X-Ctx-Session"]) == 2


def test_thinking_signature_crosses_turns_byte_identical(gw: Gateway, up: ScriptedUpstream) -> None:
    cli, headers = client(gw), session()
    history: list[dict[str, Any]] = [{"role": "user", "content": "think, then answer"}]
    first = cli.messages.create(model="claude-thinking", max_tokens=64, messages=history,  # type: ignore[arg-type]
                                thinking={"type": "enabled", "budget_tokens": 32}, extra_headers=headers)
    thinking = first.content[0]
    assert thinking.type == "thinking" and thinking.signature == signature(THOUGHT)
    history += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": "and now?"}]
    cli.messages.create(model="claude-thinking", max_tokens=64, messages=history,  # type: ignore[arg-type]
                        thinking={"type": "enabled", "budget_tokens": 32}, extra_headers=headers)
    raw = sent(up)[-1].raw
    assert json.dumps(thinking.model_dump(), separators=(",", ":")).encode() in raw


def test_count_tokens_answers_the_providers_count_of_what_would_be_forwarded(gw: Gateway,
                                                                             up: ScriptedUpstream) -> None:
    raw = client(gw).messages.with_raw_response.count_tokens(
        model="claude-x", system="Be brief.", messages=[{"role": "user", "content": "hello there"}],
        extra_headers=session())
    assert raw.headers["x-ctx-count"] == "after-compaction" and raw.headers["x-ctx-levels"] == "none"
    # No model call: one call of Anthropic's free count_tokens, on the conversation as it would be forwarded.
    [counted] = sent(up, "count_tokens")
    assert sent(up) == [] and counted.body["messages"] == [{"role": "user", "content": "hello there"}]
    assert raw.parse().input_tokens == anthropic_input_tokens(counted.body)
    assert raw.headers["x-ctx-tokenizer"] == "anthropic:count_tokens"


def test_count_tokens_below_the_trigger_reaches_the_upstream_byte_for_byte(gw: Gateway, up: ScriptedUpstream) -> None:
    """What Claude Code asks count_tokens (system blocks, cache_control, tools) is what the
    provider counts, as the client sent it."""
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    body = {"model": "claude-x", "system": system,
            "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object", "properties": {}}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]}
    raw = json.dumps(body).encode()
    up.reset()
    reply = httpx.post(gw.base + "/v1/messages/count_tokens", content=raw, timeout=30,
                       headers={"x-api-key": CLAUDE_KEY, "content-type": "application/json",
                                "anthropic-beta": "token-counting-2024-11-01", **session()})
    assert reply.status_code == 200, reply.text
    [counted] = sent(up, "count_tokens")
    assert counted.raw == raw and counted.headers.get("anthropic-beta") == "token-counting-2024-11-01"


def test_count_tokens_through_the_adapter_is_the_estimate(gw: Gateway, up: ScriptedUpstream) -> None:
    raw = client(gw).messages.with_raw_response.count_tokens(
        model="claude-v1-adapter", messages=[{"role": "user", "content": "hello there"}], extra_headers=session())
    assert raw.parse().input_tokens > 0 and up.log == []
    assert raw.headers["x-ctx-tokenizer"] == "estimate"


def test_a_first_turn_the_estimate_would_compact_is_judged_by_the_providers_count(
        gw: Gateway, up: ScriptedUpstream) -> None:
    """Claude has no public tokenizer: ctxgate's estimate (UTF-8 bytes / 3) runs high on
    plain English. A session's first turn that the estimate puts past the trigger asks
    Anthropic's count_tokens once, and is not compacted when the provider's count is under it."""
    budget = 6000
    headers = {**session(), "X-Ctx-Budget": str(budget)}
    history: list[dict[str, Any]] = [{"role": "user", "content": "The task: summarise these notes."}]
    for i in range(12):
        history += [{"role": "assistant", "content": f"Noted part {i}."},
                    {"role": "user", "content": f"Part {i}: " + "the plain words of a long note " * 45}]
    raw = client(gw).messages.with_raw_response.create(model="claude-x", max_tokens=16, messages=history,
                                                       extra_headers=headers)
    raw.parse()
    estimate = int(raw.headers["x-ctx-tokens-in"])
    [counted] = sent(up, "count_tokens")
    provider = anthropic_input_tokens(counted.body)
    assert estimate > 0.85 * budget > provider  # the estimate alone would have compacted this turn
    assert raw.headers["x-ctx-levels"] == "none" and raw.headers["x-ctx-tokenizer"] == "anthropic:count_tokens"
    assert sent(up)[-1].body["messages"] == history
    # The next turn is calibrated by the reply's usage: no second count.
    history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Go on."}]
    raw = client(gw).messages.with_raw_response.create(model="claude-x", max_tokens=16, messages=history,
                                                       extra_headers=headers)
    raw.parse()
    assert raw.headers["x-ctx-levels"] == "none" and len(sent(up, "count_tokens")) == 1


def test_x_api_key_auth_and_a_wrong_key(gw: Gateway, up: ScriptedUpstream) -> None:
    body = json.dumps({"model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    request = urllib.request.Request(gw.base + "/v1/messages", data=body.encode(), headers={
        "x-api-key": CLAUDE_KEY, "content-type": "application/json", "anthropic-version": "2023-06-01"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert json.loads(r.read())["content"][0]["text"] == REPLY
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(gw, "sk-wrong").messages.create(model="claude-x", max_tokens=8,
                                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "Incorrect API key provided for this gateway"}}
    assert len(sent(up)) == 1


@pytest.mark.parametrize("bad", [
    {"messages": "not a list"},
    {"messages": [{"role": "tool", "content": "hi"}]},
    {"messages": [{"role": "user"}]},
    {"max_tokens": 0},
    {"max_tokens": None},
    {"model": ""},
])
def test_bad_input_is_a_400_in_anthropics_shape_and_changes_nothing(gw: Gateway, up: ScriptedUpstream,
                                                                    bad: dict[str, Any]) -> None:
    cli, headers = client(gw), session()
    cli.messages.create(model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                        extra_headers=headers)
    good: dict[str, Any] = {"model": "claude-x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    request = {k: v for k, v in {**good, **bad}.items() if v is not None}
    with pytest.raises(anthropic.BadRequestError) as e:  # posted as is: the SDK's own checks would stop some
        cli.post("/v1/messages", body=request, cast_to=object, options={"headers": headers})
    assert e.value.body["type"] == "error"  # type: ignore[index]
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert len(sent(up)) == 1 and turns_of(gw, headers["X-Ctx-Session"]) == 1


def test_a_system_turn_among_the_messages_is_forwarded_in_its_place(gw: Gateway, up: ScriptedUpstream) -> None:
    """Claude Code sends system turns among its messages (its environment, reminders): they
    reach the upstream where and as the client sent them, not refused, not moved into `system`."""
    body = {"model": "claude-x", "max_tokens": 8, "system": [{"type": "text", "text": "You are terse."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "system", "content": [{"type": "text", "text": "# Environment\nLinux"}]}]}
    raw = json.dumps(body).encode()
    up.reset()
    reply = httpx.post(gw.base + "/v1/messages", content=raw, timeout=30,
                       headers={"x-api-key": CLAUDE_KEY, "content-type": "application/json", **session()})
    assert reply.status_code == 200, reply.text
    assert sent(up)[-1].raw == raw


def test_a_compacted_conversation_keeps_a_system_turn_in_its_place() -> None:
    body = {"system": "You are terse.", "messages": [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "done"},
        {"role": "system", "content": "Reminder: tests pass."}, {"role": "user", "content": "next"}]}
    conversation = conversation_of(body)
    compacted = [m for m in conversation.neutral if m.get("content") != "first"]
    system, turns = render(conversation, compacted)
    assert system == "You are terse."
    assert [(m["role"], m["content"]) for m in turns] == [
        ("user", COMPACTED_OPENING), ("assistant", "done"), ("system", "Reminder: tests pass."), ("user", "next")]


def test_unknown_model_is_a_404_in_anthropics_shape(gw: Gateway) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client(gw).messages.create(model="claude-nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_upstream_errors_pass_through_in_anthropics_shape(gw: Gateway) -> None:
    cli = client(gw)
    with pytest.raises(anthropic.OverloadedError) as overloaded:
        cli.messages.create(model="claude-529", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert overloaded.value.body == {"type": "error", "error": {"type": "overloaded_error",
                                                               "message": "scripted upstream error 529"}}
    with pytest.raises(anthropic.RateLimitError) as limited:
        cli.messages.create(model="claude-429", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


def test_litellm_adapter_path_whole_and_streamed(gw: Gateway, up: ScriptedUpstream) -> None:
    cli, headers = client(gw), session()
    msg = cli.messages.create(model="gpt-4o", max_tokens=16, system="Be brief.",
                              messages=[{"role": "user", "content": "hi"}], extra_headers=headers)
    assert msg.content[0].text == REPLY  # type: ignore[union-attr]
    with cli.messages.stream(model="gpt-4o-tools", max_tokens=16, tools=TOOLS,  # type: ignore[arg-type]
                             messages=[{"role": "user", "content": "list"}], extra_headers=headers) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert final.content[0].input == {"path": "a.py"}
    assert [e.door for e in up.log] == ["chat", "chat"] and up.log[0].body["messages"][0]["role"] == "system"
    assert turns_of(gw, headers["X-Ctx-Session"]) == 2


def test_prompt_too_long_compacts_reactively_then_exhausts(gw: Gateway, up: ScriptedUpstream) -> None:
    cli, history = client(gw), [{"role": "user", "content": TASK}]
    for i in range(20):
        history += _step(i, thinking=False)
    up.limit = anthropic_input_tokens({"messages": history}) // 2
    raw = cli.messages.with_raw_response.create(model="claude-x", max_tokens=16, messages=history,  # type: ignore
                                                extra_headers=session())
    assert raw.parse().content[0].text == REPLY  # type: ignore[union-attr]
    refused, answered = sent(up)
    assert "prompt is too long" in refused.response.decode() and answered.prompt_tokens <= up.limit
    assert raw.headers["x-ctx-levels"] != "none"
    with pytest.raises(anthropic.BadRequestError) as e:  # this model refuses any prompt, however compacted
        cli.messages.create(model="claude-overflow", max_tokens=16, messages=history,  # type: ignore[arg-type]
                            extra_headers=session())
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert e.value.body["error"]["message"].startswith("CONTEXT_EXHAUSTED")  # type: ignore[index]


# -- a long Claude-Code-shaped session, past the budget -------------------------------------
OUTPUT = "collected 12 items; test_core.py::test_app FAILED at line {i}; traceback follows " * 12
TASK = "Fix the failing test in pkg/core/app.py. Task id UNIQUE-TASK-4242."


def _step(i: int, thinking: bool) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": f"Step {i}: checking the build."},
                                    {"type": "tool_use", "id": f"toolu_{i:03d}", "name": "bash",
                                     "input": {"command": f"pytest -x pkg/core  # run {i}"}}]
    if thinking:
        thought = f"step {i}: the failure moves"
        blocks.insert(0, {"type": "thinking", "thinking": thought, "signature": signature(thought)})
    return [{"role": "assistant", "content": blocks},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i:03d}",
                                          "content": OUTPUT.format(i=i)}]}]


def _check_valid(fm: list[dict[str, Any]]) -> None:
    assert fm[0]["role"] == "user" and all(a["role"] != b["role"] for a, b in zip(fm, fm[1:]))
    for before, m in zip([None, *fm], fm):
        results = {b["tool_use_id"] for b in m["content"] if isinstance(m["content"], list)
                   and b.get("type") == "tool_result"}
        asked = (before or {}).get("content", [])
        uses = {b["id"] for b in asked if isinstance(b, dict) and b.get("type") == "tool_use"}
        assert results <= uses


def _breakpoints(body: dict[str, Any]) -> int:
    blocks = [*(body["system"] if isinstance(body.get("system"), list) else []), *body.get("tools", [])]
    blocks += [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]]
    return sum("cache_control" in b for b in blocks)


@pytest.mark.parametrize("thinking_throughout", [False, True])
def test_long_claude_code_session_is_compacted_and_stays_valid(gw: Gateway, up: ScriptedUpstream,
                                                               thinking_throughout: bool) -> None:
    cli, budget = client(gw), 6000
    headers = {**session(), "X-Ctx-Budget": str(budget)}
    system = [{"type": "text", "text": "You are Claude Code, a coding agent.", "cache_control": {"type": "ephemeral"}}]
    history: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    for i in range(32):
        history += _step(i, thinking=thinking_throughout)
    forwarded: list[dict[str, Any]] = []
    records: list[int] = []
    for turn in range(8):
        history += _step(32 + turn, thinking=True)
        last = copy.deepcopy(history[-1])
        last["content"][-1]["cache_control"] = {"type": "ephemeral"}  # Claude Code marks its newest message
        messages = [*history[:-1], last]
        raw = cli.messages.with_raw_response.create(model="claude-x", max_tokens=64, system=system,  # type: ignore
                                                    tools=TOOLS, messages=messages, extra_headers=headers)
        assert raw.parse().content[0].text == REPLY  # type: ignore[union-attr]
        # A turn compacts (levels named), or forwards the stored compaction and what came since.
        assert raw.headers["x-ctx-levels"] != "none" or turn > 0
        assert int(raw.headers["x-ctx-tokens-out"]) < int(raw.headers["x-ctx-tokens-in"])
        entry = sent(up)[-1]
        body, fm = entry.body, entry.body["messages"]
        assert entry.prompt_tokens <= budget
        _check_valid(fm)
        assert _breakpoints(body) <= 4
        assert fm[-2:] == messages[-2:] and fm[-2]["content"][0]["signature"] == messages[-2]["content"][0]["signature"]
        assert "UNIQUE-TASK-4242" in json.dumps(body)
        signed = [m for m in fm if m["role"] == "assistant" and m["content"][0].get("type") == "thinking"]
        assert signed and all(m in messages for m in signed)  # kept byte for byte, or not at all
        forwarded.append(body)
        status, summary = gw.get(f"/v1/ctx/sessions/{headers['X-Ctx-Session']}", {"x-api-key": CLAUDE_KEY})
        assert status == 200 and summary["turns"] == turn + 1 and summary["records"] and summary["wal_seq"] > 0
        records.append(len(summary["compactions"]))
    steady = [t for t in range(1, len(forwarded)) if records[t] == records[t - 1]]
    assert steady, f"every turn compacted anew: {records}"
    for t in steady:
        before, now = forwarded[t - 1], forwarded[t]
        assert json.dumps(now["system"]) == json.dumps(before["system"])
        kept = len(before["messages"]) - 1  # the newest message then carried the cache marker
        assert json.dumps(now["messages"][:kept]) == json.dumps(before["messages"][:kept])


# -- the reply readers and the rendering rules on their own
def test_stream_watch_reads_events_split_anywhere() -> None:
    frames = [
        {"type": "message_start", "message": {"usage": {"input_tokens": 10, "cache_read_input_tokens": 90,
                                                         "cache_creation_input_tokens": 5, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_1",
                                                                        "name": "bash", "input": {}}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"a"'}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": ": 1}"}},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 7}},
        {"type": "message_stop"}]
    data = b"".join(f"event: {f['type']}\ndata: {json.dumps(f)}\n\n".encode() for f in frames)
    watch = MessagesStream(keep_all=True)
    for i in range(0, len(data), 7):
        assert not watch.complete
        watch.feed(data[i:i + 7])
    facts = watch.facts()
    assert watch.complete and watch.body() == data and facts.prompt_tokens == 105
    assert facts.tool_calls == [{"id": "toolu_1", "type": "function",
                                 "function": {"name": "bash", "arguments": '{"a": 1}'}}]
    whole = {"content": [{"type": "tool_use", "id": "t", "name": "n", "input": {"x": 1}}],
             "usage": {"input_tokens": 3, "cache_read_input_tokens": 4}}
    assert reply_facts(json.dumps(whole).encode()).prompt_tokens == 7


def _use(i: int) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"t{i}", "name": "bash", "input": {"n": i}}


def _result(i: int) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"out {i}"}


def test_render_unchanged_keeps_the_clients_system_and_messages() -> None:
    body = {"system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "hi"}]}
    system, turns = render(conversation_of(body), conversation_of(body).neutral)
    assert system is body["system"] and turns == body["messages"]


def test_render_puts_quoted_notes_in_user_turns_and_keeps_the_newest_turn_verbatim() -> None:
    """A compaction dropped the first call: its notes join the task's turn (not the newest),
    ctxgate's notice joins `system`, and the newest turn reaches the upstream as sent."""
    body = {"system": "S", "messages": [
        {"role": "user", "content": "task"}, {"role": "assistant", "content": [_use(1)]},
        {"role": "user", "content": [_result(1)]}, {"role": "assistant", "content": [_use(2)]},
        {"role": "user", "content": [_result(2)]}]}
    snip = context_note(SNIP, "compaction: snip", "[ctxgate: context snipped] 2 messages")
    restore = context_note("restore", "restore: pending tasks", "[ctxgate: restored state] Pending tasks: x")
    conversation = conversation_of(body)
    system, turns = render(conversation, [conversation.neutral[0], notice_message(), conversation.neutral[1], snip,
                                          restore, *conversation.neutral[4:]])
    assert system == [{"type": "text", "text": "S"}, {"type": "text", "text": NOTICE}]
    assert turns[0] == {"role": "user", "content": [
        {"type": "text", "text": "task"}, {"type": "text", "text": snip["content"]},
        {"type": "text", "text": restore["content"], "cache_control": {"type": "ephemeral"}}]}
    assert turns[1:] == body["messages"][3:] and turns[-1] is body["messages"][-1]
    assert not any(TAG in m for m in turns)


def test_render_never_merges_a_note_into_the_newest_user_turn() -> None:
    """The memory block before a conversation's only turn, and a note right before the newest
    turn: a user turn of their own, then ctxgate's fixed assistant turn, then the client's."""
    body = {"system": "S", "messages": [{"role": "user", "content": "hi"}]}
    conversation = conversation_of(body)
    memory = block_message("Long-term memory: x")
    _, turns = render(conversation, [conversation.neutral[0], notice_message(), memory, conversation.neutral[1]])
    assert turns == [{"role": "user", "content": [{"type": "text", "text": memory["content"],
                                                   "cache_control": {"type": "ephemeral"}}]},
                     {"role": "assistant", "content": CONTEXT_ACK}, body["messages"][0]]
    body = {"messages": [{"role": "user", "content": "task"}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "newest"}]}
    conversation = conversation_of(body)
    note = context_note(SNIP, "compaction: snip", "[ctxgate: context snipped] 2 messages")
    _, turns = render(conversation, [*conversation.neutral[:2], note, conversation.neutral[2]])
    assert [m["role"] for m in turns] == ["user", "assistant", "user", "assistant", "user"]
    assert turns[3] == {"role": "assistant", "content": CONTEXT_ACK} and turns[4] is body["messages"][2]


def test_render_moves_notes_of_a_record_made_before_quoting_to_system_and_repairs_the_turns() -> None:
    signed = {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "S1"}, _use(2)]}
    body = {"system": "S", "messages": [
        {"role": "user", "content": "task"}, {"role": "assistant", "content": [_use(1)]},
        {"role": "user", "content": [_result(1)]}, signed, {"role": "user", "content": [_result(2)]},
        {"role": "assistant", "content": "done"}]}
    note = tag_legacy({"role": "system", "content": "[ctxgate: context snipped] 3 messages"})
    # Snip dropped the task and the first call; its result is left behind.
    system, turns = render(conversation_of(body), [{"role": "system", "content": "S"}, note, *body["messages"][2:]])
    assert system == [{"type": "text", "text": "S"},
                      {"type": "text", "text": note["content"], "cache_control": {"type": "ephemeral"}}]
    assert turns[0]["role"] == "user" and turns[0]["content"][0]["type"] == "text"  # the orphan result as text
    assert turns[1:] == body["messages"][3:]  # the signed turn, byte for byte


def test_render_drops_a_signed_turn_rather_than_edit_it() -> None:
    signed = {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "S1"}, _use(1)]}
    body = {"messages": [{"role": "user", "content": "task"}, signed, {"role": "user", "content": [_result(1)]},
                         {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]}
    edited = {**signed, "content": [signed["content"][0], {**_use(1), "input": {}}]}
    _, turns = render(conversation_of(body), [body["messages"][0], edited, *body["messages"][2:]])
    assert all(m != edited for m in turns) and turns[0]["role"] == "user"
    assert turns[0]["content"][0] == {"type": "text", "text": "task"}
    assert "tool result" in turns[0]["content"][1]["text"]  # its call went with the signed turn
    # The user's task gone: the turns still open with a user turn.
    _, turns = render(conversation_of(body), body["messages"][1:])
    assert turns[0] == {"role": "user", "content": COMPACTED_OPENING} and turns[1] is signed


def test_render_never_adds_a_fifth_breakpoint() -> None:
    marked = {"type": "text", "text": "m", "cache_control": {"type": "ephemeral"}}
    body = {"system": [marked, marked], "tools": [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [marked]}, {"role": "assistant", "content": "a"},
                         {"role": "user", "content": "b"}]}
    note = tag_legacy({"role": "system", "content": "[ctxgate: context snipped]"})
    conversation = conversation_of(body)
    system, turns = render(conversation, [conversation.neutral[0], note, *conversation.neutral[1:]])
    assert sum("cache_control" in b for b in system) == 2  # four already: none added
    assert turns[0] is body["messages"][0]  # the client's breakpoint is back on the message it sent
    system, _ = render(conversation, [conversation.neutral[0], note, *conversation.neutral[2:]])
    assert sum("cache_control" in b for b in system) == 3  # the marked message went: the note gets one


def test_a_moving_breakpoint_leaves_the_history_unchanged_in_the_neutral_model() -> None:
    marked = {"type": "ephemeral"}
    first = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": marked}]}]}
    second = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]},
                           {"role": "assistant", "content": "b"},
                           {"role": "user", "content": [{"type": "text", "text": "c", "cache_control": marked}]}]}
    assert conversation_of(first).neutral == conversation_of(second).neutral[:1]


def test_a_base_url_can_name_the_session(gw: Gateway, up: ScriptedUpstream) -> None:
    """`/s/<session>/...` serves every door: an agent configured only by its base URL (as
    `ctxgate run` sets it) still names its session; a header the client sends wins."""
    named = anthropic.Anthropic(base_url=f"{gw.base}/s/path-session-1", api_key=CLAUDE_KEY, max_retries=0)
    raw = named.messages.with_raw_response.create(model="claude-x", max_tokens=8,
                                                  messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-ctx-session"] == "path-session-1"
    raw = named.messages.with_raw_response.create(model="claude-x", max_tokens=8, extra_headers=session(),
                                                  messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-ctx-session"].startswith("msg-")
    with pytest.raises(anthropic.BadRequestError):  # an id the session rules refuse, as in the header
        anthropic.Anthropic(base_url=f"{gw.base}/s/has%20space", api_key=CLAUDE_KEY, max_retries=0).messages.create(
            model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}])


def test_a_bad_new_message_in_a_known_history_is_refused_at_its_index(gw: Gateway, up: ScriptedUpstream) -> None:
    """A steady turn checks only its new messages (the session's last request is known): a bad
    one is still a 400 that says where it is in the body, and nothing is forwarded."""
    headers = session()
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": "go on"}]
    client(gw).messages.create(model="claude-x", max_tokens=16, system="terse", messages=history,
                               extra_headers=headers)
    before = len(sent(up))
    bad = [*history, {"role": "assistant", "content": "ok"}, {"role": "wizard", "content": "x"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client(gw).messages.create(model="claude-x", max_tokens=16, system="terse", messages=bad,  # type: ignore
                                   extra_headers=headers)
    assert e.value.body["error"]["message"].startswith("messages.4.role"), e.value.body
    rewritten = [{"role": "user", "content": 5}, *history[1:], {"role": "assistant", "content": "ok"},
                 {"role": "user", "content": "more"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client(gw).messages.create(model="claude-x", max_tokens=16, system="terse", messages=rewritten,  # type: ignore
                                   extra_headers=headers)
    assert e.value.body["error"]["message"].startswith("messages.0.content"), e.value.body
    assert len(sent(up)) == before
