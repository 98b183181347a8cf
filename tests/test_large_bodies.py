"""Large request bodies: parsed in a worker process (the event loop never holds the GIL for a
whole parse), and a request whose instructions and task alone are far over every model it may
go to refused from their lengths, before any work in proportion to its size, on every door.

The parser is driven against its real worker process; the refusals through the real gateway
with the official SDKs."""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any, Iterator

import anthropic
import openai
import orjson
import pytest

from clients import KEYS, assert_error_shape, post
from ctxgate.proxy.large_json import BodyNotJson, JsonParser
from servers import UPSTREAM_KEY, Gateway, launch, main_config, stop_all
from upstream import ScriptedUpstream

LIMIT = 1000
"""The small model's context limit, in tokens."""
HUGE = "The build log repeats itself. " * 20_000
"""600,000 characters: at least 4,687 tokens for any tokenizer whose longest token is 128
bytes, over twice the small model's limit."""


def test_a_large_body_is_parsed_in_the_worker_as_in_place() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "é" * 600_000 + "end"}], "n": [1, 2.5, None]}
    raw = orjson.dumps(body)

    async def run() -> None:
        parser = JsonParser(large_bytes=1024)
        try:
            assert await parser.loads(raw) == body
            with pytest.raises(BodyNotJson, match="line 1"):
                await parser.loads(raw[:-1])
            assert parser._worker is not None  # the same worker served both
            parser._worker.kill()
            parser._worker.wait()
            assert await parser.loads(raw) == body  # a dead worker: a new one
        finally:
            parser.close()

    asyncio.run(run())


def test_a_small_body_is_parsed_in_place() -> None:
    async def run() -> None:
        parser = JsonParser()
        assert await parser.loads(b'{"a": 1}') == {"a": 1}
        assert parser._worker is None
        with pytest.raises(BodyNotJson):
            await parser.loads(b"{")

    asyncio.run(run())


def _config(upstream_url: str) -> dict[str, Any]:
    config = main_config(upstream_url, "auto")
    config["model_list"] += [
        {"model_name": "small", "model_info": {"max_input_tokens": LIMIT},
         "litellm_params": {"model": "openai/gpt-4o", "api_base": f"{upstream_url}/v1", "api_key": UPSTREAM_KEY}},
        {"model_name": "small-with-fallback", "model_info": {"max_input_tokens": LIMIT},
         "litellm_params": {"model": "openai/gpt-4o", "api_base": f"{upstream_url}/v1", "api_key": UPSTREAM_KEY}},
        {"model_name": "claude-small", "model_info": {"max_input_tokens": LIMIT},
         "litellm_params": {"model": "anthropic/claude-small", "api_base": upstream_url, "api_key": UPSTREAM_KEY}},
    ]
    config["router_settings"] = {"context_window_fallbacks": [{"small-with-fallback": ["gpt-4o-tools"]}]}
    return config


@pytest.fixture(scope="module")
def lgw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = launch("large-bodies", Path(tmp_path_factory.mktemp("large")), _config(upstream.url)).wait_ready()
    yield gw
    stop_all([gw])


def _no_session(gw: Gateway, sid: str) -> None:
    status, _ = gw.get(f"/v1/ctx/sessions/{sid}", {"Authorization": f"Bearer {KEYS['acme']}"})
    assert status == 404
    assert gw.data_dir is not None and not list(gw.data_dir.rglob(f"*{sid}*"))


def test_a_hopeless_chat_request_is_refused_before_anything(lgw: Gateway, up: ScriptedUpstream) -> None:
    sid = f"huge-{uuid.uuid4().hex[:8]}"
    resp = post(lgw, {"model": "small", "messages": [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": HUGE}]},
                headers={"X-Ctx-Session": sid})
    err = assert_error_shape(resp, 400, "context_exhausted")
    assert "far over the context limit (small: 1000)" in err["message"]
    assert up.log == []
    _no_session(lgw, sid)


def test_a_text_part_counts_as_much_as_a_string(lgw: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai.OpenAI(base_url=lgw.url, api_key=KEYS["acme"], max_retries=0).chat.completions.create(
            model="small", messages=[{"role": "user", "content": [{"type": "text", "text": HUGE}]}])
    assert caught.value.code == "context_exhausted" and up.log == []


def test_a_long_last_message_that_is_not_the_task_is_left_to_compaction(lgw: Gateway, up: ScriptedUpstream) -> None:
    """Only what no level may cut is judged from its length: a long tool output is cut by the
    levels (here to fit, or refused by the exact check), never refused from its length."""
    messages = [{"role": "user", "content": "Read the log."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": HUGE}]
    resp = post(lgw, {"model": "small", "messages": messages})
    assert "far over the context limit" not in resp.text


def test_a_larger_fallback_model_is_not_refused_from_lengths(lgw: Gateway, up: ScriptedUpstream) -> None:
    resp = post(lgw, {"model": "small-with-fallback", "messages": [{"role": "user", "content": HUGE}]})
    assert resp.status_code == 200 and resp.headers["x-ctx-fallback"] == "gpt-4o-tools"


def test_the_messages_door_refuses_in_anthropics_shape(lgw: Gateway, up: ScriptedUpstream) -> None:
    claude = anthropic.Anthropic(base_url=lgw.base, api_key=KEYS["acme"], max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="claude-small", max_tokens=16, messages=[{"role": "user", "content": HUGE}])
    assert "far over the context limit" in str(caught.value) and up.log == []
    with pytest.raises(anthropic.BadRequestError):  # a count of what cannot be sent: the same answer
        claude.messages.count_tokens(model="claude-small", messages=[{"role": "user", "content": HUGE}])
    assert up.log == []


def test_the_responses_door_refuses_too(lgw: Gateway, up: ScriptedUpstream) -> None:
    client = openai.OpenAI(base_url=lgw.url, api_key=KEYS["acme"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="small", input=HUGE)
    assert caught.value.code == "context_exhausted" and up.log == []
