"""A steady turn on the Messages door reads its body's tail and its new messages only
(proxy/doors/messages_read.py, proxy/resent.py), and must answer and forward exactly what a
session seeing the whole conversation for the first time would: the same bytes upstream, the
same count; a bad new message or field is still a 400 in Anthropic's shape, nothing forwarded.

The gateway runs in this process on a real socket (its `resent` and history cache are looked
at directly), in front of the scripted upstream, driven by the official `anthropic` SDK.
"""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

import anthropic
import httpx
import orjson
import yaml
from aiohttp import web

from ctxgate.proxy.app import create_app
from ctxgate.proxy.config import load_config
from ctxgate.proxy.doors.messages_read import ReadMessages
from ctxgate.proxy.gateway import Gateway
from ctxgate.proxy.resent import MIN_BYTES
from servers import KEYS, UPSTREAM_KEY, free_port, main_config
from upstream import ScriptedUpstream

MODEL = "claude-x"
MARK = {"type": "ephemeral"}
PAD = "The repository's layout, as the agent was told it. " * (MIN_BYTES // 40)
"""A system prompt long enough that every body is kept."""


def _gateway(up: ScriptedUpstream, tmp_path: Path) -> Gateway:
    config = main_config(up.url, "auto")
    config["model_list"].append({"model_name": MODEL, "model_info": {"max_input_tokens": 100_000}, "litellm_params": {
        "model": f"anthropic/{MODEL}", "api_base": up.url, "api_key": UPSTREAM_KEY}})
    path = tmp_path / "ctxgate.yaml"
    path.write_text(yaml.safe_dump(config))
    return Gateway.build(load_config(path), str(tmp_path / "data"))


def _serving(up: ScriptedUpstream, tmp_path: Path,
             run: Callable[[Gateway, str], Awaitable[None]]) -> None:
    gw = _gateway(up, tmp_path)

    async def served() -> None:
        runner = web.AppRunner(create_app(gw), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            await run(gw, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()
            await gw.close()

    asyncio.run(served())


def _forwarded(up: ScriptedUpstream) -> list[Any]:
    return [r for r in up.log if r.door == "messages"]


def _turn(i: int, marked: bool) -> list[dict[str, Any]]:
    """An assistant's tool call and its result, the result marked as Claude Code marks the newest message."""
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"line {i} of the log 東京"}
    if marked:
        result["cache_control"] = MARK
    return [{"role": "assistant", "content": [{"type": "text", "text": f"step {i}"},
                                              {"type": "tool_use", "id": f"t{i}", "name": "bash",
                                               "input": {"command": f"sed -n {i}p log"}}]},
            {"role": "user", "content": [result]}]


def _unmarked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": [{k: v for k, v in b.items() if k != "cache_control"} for b in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]


def test_a_steady_turn_forwards_and_counts_what_a_new_session_does(up: ScriptedUpstream, tmp_path: Path) -> None:
    """Turns that resend the last body's bytes (tail parsed) and turns whose newest message lost
    its breakpoint (tail parsed from the second cut, read from the first changed message on) alike."""
    async def run(gw: Gateway, base: str) -> None:
        client = anthropic.AsyncAnthropic(base_url=base, api_key=KEYS["acme"], max_retries=0)
        session = f"msg-resent-{uuid.uuid4().hex[:8]}"
        history: list[dict[str, Any]] = [{"role": "user", "content": "Find the failing line."}]
        last: ReadMessages | None = None
        try:
            for i in range(6):
                # Every other turn marks its newest message, as Claude Code does every turn: the
                # next turn sends that message again without its breakpoint.
                history = [*_unmarked(history), *_turn(i, i % 2 == 1)]
                hits, second = gw.resent.hits, gw.resent.second_hits

                async def post(name: str) -> tuple[Any, Any]:
                    reply = await client.messages.with_raw_response.create(
                        model=MODEL, max_tokens=64, system=PAD, messages=history,  # type: ignore[arg-type]
                        extra_headers={"X-Ctx-Session": name})
                    return reply, _forwarded(up)[-1]

                steady, sent = await post(session)
                fresh, fresh_sent = await post(f"fresh-{uuid.uuid4().hex[:8]}")
                assert steady.headers["x-ctx-tokens-in"] == fresh.headers["x-ctx-tokens-in"]
                assert sent.raw == fresh_sent.raw and sent.body["messages"] == history
                read = gw.histories.door_state("acme", session)
                assert isinstance(read, ReadMessages) and read.neutral is not None
                if i > 0:
                    # Resent bytes: the tail alone was parsed. A breakpoint taken off the last
                    # turn's newest message: its bytes changed, so the tail from the second cut
                    # (the end of the message before it) was parsed, and the messages before it
                    # are still read once: their neutral copies are last turn's own.
                    assert gw.resent.hits == hits + 1
                    assert gw.resent.second_hits == second + (1 if i % 2 == 0 else 0)
                    assert last is not None and last.neutral is not None
                    same = len(last.neutral) - (1 if i % 2 == 0 else 0)
                    assert all(a is b for a, b in zip(read.neutral[:same], last.neutral[:same]))
                    assert read.neutral[same:] == _unmarked(history[same - 1:])
                last = read
        finally:
            await client.close()

    _serving(up, tmp_path, run)


def test_claude_codes_moving_breakpoint_reads_from_the_second_cut(up: ScriptedUpstream, tmp_path: Path) -> None:
    """Claude Code's shape: every turn marks its newest message, so the last turn's newest
    message comes back with other bytes. Each steady turn after the second is read from the second cut (the end
    of the message before it) and forwards and counts what a whole body's parse does, its tools
    and system the same too."""
    tools = [{"name": "bash", "description": "Runs a command: `a, b` [x] {y} \"z\"",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]

    async def run(gw: Gateway, base: str) -> None:
        client = anthropic.AsyncAnthropic(base_url=base, api_key=KEYS["acme"], max_retries=0)
        session = f"msg-cc-{uuid.uuid4().hex[:8]}"
        system: list[dict[str, Any]] = [{"type": "text", "text": PAD, "cache_control": MARK}]
        history: list[dict[str, Any]] = [{"role": "user", "content": [
            {"type": "text", "text": "Find the failing line: },{ ], [ \\\" ,", "cache_control": MARK}]}]
        try:
            for i in range(5):
                if i:
                    history = [*_unmarked(history), *_turn(i, True)]
                hits, second = gw.resent.hits, gw.resent.second_hits

                async def post(name: str) -> tuple[Any, Any]:
                    reply = await client.messages.with_raw_response.create(
                        model=MODEL, max_tokens=64, system=system, messages=history,  # type: ignore[arg-type]
                        tools=tools, extra_headers={"X-Ctx-Session": name})  # type: ignore[arg-type]
                    return reply, _forwarded(up)[-1]

                steady, sent = await post(session)
                fresh, fresh_sent = await post(f"fresh-{uuid.uuid4().hex[:8]}")
                answers = [{k: v for k, v in orjson.loads(r.http_response.content).items() if k != "id"}
                           for r in (steady, fresh)]
                assert steady.status_code == 200 and answers[0] == answers[1]
                assert steady.headers["x-ctx-tokens-in"] == fresh.headers["x-ctx-tokens-in"]
                assert sent.raw == fresh_sent.raw and sent.body["messages"] == history
                assert sent.body["tools"][0]["description"] == tools[0]["description"]
                # The first turn's one message has no message before it: the second turn parses whole.
                assert (gw.resent.hits, gw.resent.second_hits) == ((hits, second) if i < 2 else (hits + 1, second + 1))
        finally:
            await client.close()

    _serving(up, tmp_path, run)


def test_a_bad_new_message_or_field_in_a_resent_body_is_refused(up: ScriptedUpstream, tmp_path: Path) -> None:
    async def run(gw: Gateway, base: str) -> None:
        session = f"msg-resent-bad-{uuid.uuid4().hex[:8]}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}, *_turn(0, False)]
        raw = orjson.dumps({"model": MODEL, "system": PAD, "messages": messages, "max_tokens": 64})
        head, tail = raw[:raw.rindex(b"]")], raw[raw.rindex(b"]"):]
        async with httpx.AsyncClient(base_url=base, timeout=60, headers={
                "x-api-key": KEYS["acme"], "anthropic-version": "2023-06-01", "X-Ctx-Session": session}) as http:
            assert (await http.post("/v1/messages", content=raw)).status_code == 200
            before = len(_forwarded(up))
            bad_message = head + b',{"role":"assistant","content":"ok"},{"role":"wizard","content":"x"}' + tail
            bad_block = head + b',{"role":"assistant","content":[{"type":"text","text":"a"},5]}' + tail
            deep = head + b',{"role":"assistant","content":[{"type":"text","text":"a","x":' + b"[" * 300 \
                + b"]" * 300 + b"}]}" + tail
            bad_field = raw[:-1] + b',"stream":"yes"}'
            for body, where in [(bad_message, f"messages.{len(messages) + 1}.role"),
                                (bad_block, f"messages.{len(messages)}.content"), (deep, None),
                                (bad_field, "stream")]:
                hits = gw.resent.hits
                refused = await http.post("/v1/messages", content=body)
                assert gw.resent.hits == hits + 1  # the tail alone was parsed
                assert refused.status_code == 400, refused.text
                error = refused.json()
                assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
                if where is None:
                    assert "nests" in error["error"]["message"]
                else:
                    assert error["error"]["message"].startswith(where), error
            # The history itself rewritten (its first message now bad) is checked whole.
            rewritten = raw.replace(b'"content":"hi"', b'"content":5', 1)
            refused = await http.post("/v1/messages", content=rewritten)
            assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("messages.0.content")
            assert len(_forwarded(up)) == before

    _serving(up, tmp_path, run)
