"""A faulty upstream, through the real gateway: what the client's SDK sees, what the WAL holds.

A 200 whose body is not the API's reply is a 502 in the door's shape; a stream with an event
that is not JSON, or one that stops before its last event, ends with the door's error event;
none of them is logged as an answered turn. Retries follow LiteLLM's config keys, only
before a byte has gone to the client, honouring the upstream's `Retry-After`."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from clients import KEYS, MESSAGES, client
from conftest import FORWARDING
from ctxgate.proxy.config import Config
from ctxgate.proxy.upstream.retry import MAX_WAIT_S, RetryPolicy, asked_wait_s
from ctxgate.proxy.upstream.routing import retry_policy
from ctxgate.wal.paths import WalPaths
from ctxgate.wal.reader import scan_file
from servers import METRICS_HEADERS, UPSTREAM_KEY, Gateway, main_config, run_ctxgate, start_gateways, stop_all
from upstream import BROKEN_EVENT, ScriptedUpstream

CLAUDE = {"claude-fault-notjson": "fault-notjson", "claude-fault-shape": "fault-shape",
          "claude-fault-brokensse": "fault-brokensse", "claude-fault-unterminated": "fault-unterminated",
          "claude-flaky-429": "flaky-429"}


def fault_config(upstream_url: str, forwarding: str) -> dict[str, Any]:
    """Every name through a wildcard to the scripted upstream, retried twice; a few deployments
    with their own retries and timeout; Claude names natively to its Messages API."""
    config = main_config(upstream_url, forwarding)
    base = f"{upstream_url}/v1"

    def entry(name: str, model: str, **params: Any) -> dict[str, Any]:
        return {"model_name": name, "model_info": {"max_input_tokens": 100_000},
                "litellm_params": {"model": model, "api_base": base, "api_key": UPSTREAM_KEY, **params}}

    config["model_list"] = [e for e in config["model_list"] if e["model_name"] not in ("slow", "overflow")] + [
        entry("no-retry-500", "openai/flaky-500", num_retries=0),
        entry("slow", "openai/slow", timeout=0.5, num_retries=1),
        entry("overflow", "openai/overflow"),
        *[{**entry(name, f"anthropic/{model}"), "litellm_params": {
            "model": f"anthropic/{model}", "api_base": upstream_url, "api_key": UPSTREAM_KEY}}
          for name, model in CLAUDE.items()],
        entry("*", "openai/*"),
    ]
    config["router_settings"] = {"num_retries": 2, "retry_after": 0, "timeout": 30,
                                 "fallbacks": [{"gpt-4o": ["summarizer"]}]}
    return config


@pytest.fixture(scope="module")
def fault_gateways(upstream: ScriptedUpstream,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Gateway]]:
    base = tmp_path_factory.mktemp("faults")
    gateways = start_gateways({f: (base / f, fault_config(upstream.url, f)) for f in FORWARDING})
    yield gateways
    stop_all(gateways.values())


@pytest.fixture(params=FORWARDING)
def gw(request: pytest.FixtureRequest, fault_gateways: dict[str, Gateway]) -> Gateway:
    return fault_gateways[request.param]


@pytest.fixture
def native(fault_gateways: dict[str, Gateway]) -> Gateway:
    """ctxgate's own client: the upstream's bytes reach the client untouched."""
    return fault_gateways["auto"]


def session() -> str:
    return f"fault-{uuid.uuid4().hex[:12]}"


def messages(text: str = "Hello") -> list[dict[str, Any]]:
    """A conversation of its own: `flaky-*` fails the first request with exactly these bytes."""
    return [*MESSAGES[:-1], {"role": "user", "content": f"{text} {uuid.uuid4().hex}"}]


def wal_events(gw: Gateway, sid: str, kind: str) -> list[dict[str, Any]]:
    assert gw.data_dir is not None
    path: Path = WalPaths(gw.data_dir).live("acme", sid)
    return [e for e in scan_file(path).events if e.get("type") == kind] if path.exists() else []


def chat_calls(up: ScriptedUpstream, model: str) -> list[Any]:
    return [r for r in up.log if r.door == "chat" and isinstance(r.body, dict) and r.body.get("model") == model]


def raw_chat(gw: Gateway, body: dict[str, Any], sid: str) -> httpx.Response:
    return httpx.post(gw.url + "/chat/completions", json=body, timeout=30, headers={
        "Authorization": f"Bearer {KEYS['acme']}", "X-Ctx-Session": sid})


def sse_data(raw: bytes) -> list[Any]:
    """The data of each event, parsed (every one must parse: that is the point)."""
    out = []
    for event in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if data and data != b"[DONE]":
            out.append(json.loads(data))
    return out


def retries(gw: Gateway, model: str, reason: str) -> float:
    text = httpx.get(gw.base + "/metrics", headers=METRICS_HEADERS, timeout=10).text
    wanted = f'ctxgate_upstream_retries_total{{model="{model}",reason="{reason}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted))


# -- whole replies that are not the API's ------------------------------------------------

@pytest.mark.parametrize("model", ["fault-notjson", "fault-shape"])
def test_a_200_that_is_not_a_chat_completion_is_a_502(native: Gateway, up: ScriptedUpstream, model: str) -> None:
    sid = session()
    with pytest.raises(openai.APIStatusError) as caught:  # not a JSONDecodeError, nor a half-built object
        client(native).chat.completions.create(model=model, messages=messages(),
                                               extra_headers={"X-Ctx-Session": sid})
    assert caught.value.status_code == 502 and caught.value.code == "upstream_bad_reply"
    assert isinstance(caught.value.body, dict) and "not a chat reply" in caught.value.body["message"]
    assert len(chat_calls(up, model)) == 1  # a reply came: nothing to retry
    assert wal_events(native, sid, "USER_INPUT") and wal_events(native, sid, "RESPONSE") == []


def test_a_reply_cut_mid_body_is_retried_then_a_502(native: Gateway, up: ScriptedUpstream) -> None:
    """The upstream drops the connection halfway through a whole reply: nothing has reached the
    client yet, so it is retried (twice, as configured), then the client gets a clean 502."""
    sid = session()
    with pytest.raises(openai.APIStatusError) as caught:
        client(native).chat.completions.create(model="fault-reset", messages=messages(),
                                               extra_headers={"X-Ctx-Session": sid})
    assert caught.value.status_code == 502, caught.value.body
    assert isinstance(caught.value.body, dict) and isinstance(caught.value.body.get("message"), str)
    assert len(chat_calls(up, "fault-reset")) == 3
    assert wal_events(native, sid, "USER_INPUT") and wal_events(native, sid, "RESPONSE") == []


@pytest.mark.parametrize("model", ["fault-notjson", "fault-shape"])
def test_a_bad_reply_through_litellm_is_a_502_too(fault_gateways: dict[str, Gateway], up: ScriptedUpstream,
                                                 model: str) -> None:
    sid = session()
    with pytest.raises(openai.APIStatusError) as caught:
        client(fault_gateways["litellm"]).chat.completions.create(model=model, messages=messages(),
                                                                  extra_headers={"X-Ctx-Session": sid})
    assert caught.value.status_code == 502 and caught.value.code == "upstream_bad_reply"
    assert len(chat_calls(up, model)) == 1  # litellm calls it a 500: it is not retried as one
    assert wal_events(fault_gateways["litellm"], sid, "RESPONSE") == []


@pytest.mark.parametrize("model", ["fault-brokensse", "fault-unterminated"])
def test_a_broken_stream_through_litellm_ends_with_an_error_event(fault_gateways: dict[str, Gateway],
                                                                 up: ScriptedUpstream, model: str) -> None:
    sid = session()
    with pytest.raises(openai.APIError):
        list(client(fault_gateways["litellm"]).chat.completions.create(
            model=model, messages=messages(), stream=True, extra_headers={"X-Ctx-Session": sid}))
    assert len(chat_calls(up, model)) == 1 and wal_events(fault_gateways["litellm"], sid, "RESPONSE") == []


@pytest.mark.parametrize("model", ["fault-notjson", "fault-shape"])
def test_a_200_that_is_not_a_response_is_a_502_on_the_responses_door(native: Gateway, up: ScriptedUpstream,
                                                                     model: str) -> None:
    sid = session()
    with pytest.raises(openai.APIStatusError) as caught:
        client(native).responses.create(model=model, input=f"hi {uuid.uuid4().hex}",
                                        extra_headers={"X-Ctx-Session": sid})
    assert caught.value.status_code == 502 and caught.value.code == "upstream_bad_reply"
    assert wal_events(native, sid, "RESPONSE") == []


@pytest.mark.parametrize("model", ["claude-fault-notjson", "claude-fault-shape"])
def test_a_200_that_is_not_a_message_is_a_502_in_anthropics_shape(native: Gateway, up: ScriptedUpstream,
                                                                 model: str) -> None:
    sid = session()
    claude = anthropic.Anthropic(base_url=native.base, api_key=KEYS["acme"], max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.messages.create(model=model, max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                               extra_headers={"X-Ctx-Session": sid})
    assert caught.value.status_code == 502
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "api_error"
    assert "not a messages reply" in body["error"]["message"]
    assert wal_events(native, sid, "RESPONSE") == []


# -- streams -------------------------------------------------------------------------------

def test_a_stream_event_that_is_not_json_ends_the_stream_with_an_error_event(native: Gateway,
                                                                             up: ScriptedUpstream) -> None:
    sid = session()
    stream = client(native).chat.completions.create(model="fault-brokensse", messages=messages(), stream=True,
                                                    extra_headers={"X-Ctx-Session": sid})
    with pytest.raises(openai.APIError) as caught:  # the SDK's own error, not a JSONDecodeError
        list(stream)
    assert "not JSON" in caught.value.message
    sent = chat_calls(up, "fault-brokensse")
    assert len(sent) == 1  # retries are configured: none once a byte went out
    raw = raw_chat(native, {"model": "fault-brokensse", "messages": messages(), "stream": True}, sid).content
    upstream_bytes = chat_calls(up, "fault-brokensse")[-1].response
    before = upstream_bytes[:upstream_bytes.index(BROKEN_EVENT)]
    assert raw.startswith(before) and BROKEN_EVENT not in raw  # byte for byte up to the broken event
    assert sse_data(raw[len(before):])[-1]["error"]["code"] == "upstream_bad_reply"
    assert wal_events(native, sid, "RESPONSE") == []


def test_a_stream_that_stops_early_gets_an_error_event(native: Gateway, up: ScriptedUpstream) -> None:
    sid = session()
    body = {"model": "fault-unterminated", "messages": messages(), "stream": True,
            "stream_options": {"include_usage": True}}
    raw = raw_chat(native, body, sid)
    upstream_bytes = chat_calls(up, "fault-unterminated")[-1].response
    assert raw.status_code == 200 and raw.content.startswith(upstream_bytes)  # everything it sent, unchanged
    assert sse_data(raw.content[len(upstream_bytes):]) == [sse_data(raw.content)[-1]]
    assert sse_data(raw.content)[-1]["error"]["code"] == "upstream_incomplete"
    with pytest.raises(openai.APIError):
        list(client(native).chat.completions.create(model="fault-unterminated", messages=messages(), stream=True,
                                                    extra_headers={"X-Ctx-Session": sid}))
    assert wal_events(native, sid, "RESPONSE") == [] and len(chat_calls(up, "fault-unterminated")) == 2


def test_a_whole_stream_is_relayed_byte_for_byte_and_settled(native: Gateway, up: ScriptedUpstream) -> None:
    sid = session()
    raw = raw_chat(native, {"model": "gpt-4o", "messages": messages(), "stream": True}, sid)
    assert raw.content == chat_calls(up, "gpt-4o")[-1].response
    assert len(wal_events(native, sid, "RESPONSE")) == 1


@pytest.mark.parametrize("model", ["claude-fault-brokensse", "claude-fault-unterminated"])
def test_a_broken_messages_stream_ends_with_anthropics_error_event(native: Gateway, up: ScriptedUpstream,
                                                                  model: str) -> None:
    sid = session()
    claude = anthropic.Anthropic(base_url=native.base, api_key=KEYS["acme"], max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught:
        with claude.messages.stream(model=model, max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                    extra_headers={"X-Ctx-Session": sid}) as stream:
            list(stream)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "api_error"
    assert len([r for r in up.log if r.door == "messages"]) == 1
    assert wal_events(native, sid, "RESPONSE") == []


@pytest.mark.parametrize("model", ["fault-brokensse", "fault-unterminated"])
def test_a_broken_responses_stream_ends_with_its_error_event(native: Gateway, up: ScriptedUpstream,
                                                            model: str) -> None:
    sid = session()
    events = list(client(native).responses.create(model=model, input=f"hi {uuid.uuid4().hex}", stream=True,
                                                  extra_headers={"X-Ctx-Session": sid}))
    assert events[-1].type == "error"
    assert events[-1].code == ("upstream_bad_reply" if "broken" in model else "upstream_incomplete")
    assert not any(e.type == "response.completed" for e in events)
    assert len([r for r in up.log if r.door == "responses"]) == 1
    assert wal_events(native, sid, "RESPONSE") == []


# -- retries ------------------------------------------------------------------------------

@pytest.mark.parametrize("status", [429, 500])
def test_a_transient_status_is_retried_before_the_client_sees_it(gw: Gateway, up: ScriptedUpstream,
                                                                  status: int) -> None:
    sid, model = session(), f"flaky-{status}"
    before = retries(gw, model, str(status))
    reply = client(gw).chat.completions.create(model=model, messages=messages(),
                                               extra_headers={"X-Ctx-Session": sid})
    assert reply.choices[0].message.content == "ok"
    calls = chat_calls(up, model)
    assert len(calls) == 2 and calls[0].raw == calls[1].raw  # the same request, once more
    assert retries(gw, model, str(status)) == before + 1
    assert len(wal_events(gw, sid, "RESPONSE")) == 1  # one answered turn, whatever it took


def test_a_stream_whose_first_attempt_fails_is_retried_whole(gw: Gateway, up: ScriptedUpstream) -> None:
    sid = session()
    chunks = list(client(gw).chat.completions.create(model="flaky-503", messages=messages(), stream=True,
                                                     extra_headers={"X-Ctx-Session": sid}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"
    assert len(chat_calls(up, "flaky-503")) == 2 and len(wal_events(gw, sid, "RESPONSE")) == 1


def test_a_messages_rate_limit_is_retried(native: Gateway, up: ScriptedUpstream) -> None:
    claude = anthropic.Anthropic(base_url=native.base, api_key=KEYS["acme"], max_retries=0)
    reply = claude.messages.create(model="claude-flaky-429", max_tokens=64,
                                   messages=[{"role": "user", "content": f"hi {uuid.uuid4().hex}"}])
    assert reply.content[0].type == "text" and len([r for r in up.log if r.door == "messages"]) == 2


def test_the_providers_count_is_asked_once_and_the_estimate_answers_without_it(native: Gateway,
                                                                               up: ScriptedUpstream) -> None:
    claude = anthropic.Anthropic(base_url=native.base, api_key=KEYS["acme"], max_retries=0)
    counted = claude.messages.count_tokens(model="claude-flaky-429",
                                           messages=[{"role": "user", "content": f"hi {uuid.uuid4().hex}"}])
    assert counted.input_tokens > 0 and len([r for r in up.log if r.door == "count_tokens"]) == 1


def test_a_deployment_with_no_retries_answers_the_first_error(gw: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.InternalServerError):
        client(gw).chat.completions.create(model="no-retry-500", messages=messages())
    sent = chat_calls(up, "flaky-500")
    assert len(sent) == 1 and "num_retries" not in sent[0].body  # a routing key, never a body field


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_a_request_error_is_never_retried(gw: Gateway, up: ScriptedUpstream, status: int) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client(gw).chat.completions.create(model=f"error-{status}", messages=messages())
    assert caught.value.status_code == status and len(chat_calls(up, f"error-{status}")) == 1


def test_retries_give_up_with_the_upstreams_error(gw: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        client(gw).chat.completions.create(model="error-500", messages=messages())
    assert caught.value.code == "scripted_500" and len(chat_calls(up, "error-500")) == 3  # num_retries: 2


def test_a_context_too_long_error_is_compacted_not_retried(gw: Gateway, up: ScriptedUpstream) -> None:
    """A history whose old build log the reactive compaction can cut to the half the refusal
    names: compacted and sent once more, never retried as it was. (Where no compaction can
    bring it under that limit, ctxgate answers at once: tests/test_proxy_errors.py.)"""
    log = "\n".join(f"build step {i}: compiling module_{i}.c with the usual flags" for i in range(400))
    history = [MESSAGES[0], {"role": "user", "content": "Build the project."},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "bash", "arguments": json.dumps({"command": "make"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": log},
               {"role": "assistant", "content": "It built."}, *messages()[-1:]]
    with pytest.raises(openai.BadRequestError) as caught:
        client(gw).chat.completions.create(model="overflow", messages=history,
                                           extra_headers={"X-Ctx-Session": session()})
    assert "CONTEXT_EXHAUSTED" in str(caught.value)
    first, second = chat_calls(up, "overflow")  # the first try and the one reactive compaction
    assert second.body["messages"] != first.body["messages"] and len(second.raw) < len(first.raw) / 2


def test_an_attempt_past_the_deployments_timeout_is_retried_then_504(gw: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client(gw).chat.completions.create(model="slow", messages=messages())
    assert caught.value.status_code == 504 and len(chat_calls(up, "slow")) == 2  # its own num_retries: 1


def test_a_stream_that_stalls_after_its_first_byte_is_not_retried(native: Gateway, up: ScriptedUpstream) -> None:
    sid = session()
    with pytest.raises(openai.APIError):
        list(client(native).chat.completions.create(model="slow", messages=messages(), stream=True,
                                                    extra_headers={"X-Ctx-Session": sid}))
    assert len(chat_calls(up, "slow")) == 1 and wal_events(native, sid, "RESPONSE") == []


def test_an_unreachable_upstream_is_retried_then_502(native: Gateway, up: ScriptedUpstream) -> None:
    before = retries(native, "deadend", "connection")
    with pytest.raises(openai.APIStatusError) as caught:
        client(native).chat.completions.create(model="deadend", messages=messages())
    assert caught.value.status_code == 502 and retries(native, "deadend", "connection") == before + 2


def test_a_bad_retry_setting_is_refused_at_start(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    config = main_config(upstream.url, "auto")
    config["router_settings"] = {"num_retries": "many"}
    (tmp_path / "bad.yaml").write_text(json.dumps(config))
    done = run_ctxgate(["serve", "--config", str(tmp_path / "bad.yaml"), "--data-dir", str(tmp_path / "d")], tmp_path)
    assert done.returncode != 0 and "router_settings.num_retries" in done.stdout + done.stderr


# -- the policy's waits ----------------------------------------------------------------------

def test_the_wait_is_what_the_upstream_asked_within_bounds() -> None:
    policy = RetryPolicy(num_retries=3, min_wait_s=0.2, timeout_s=30)
    assert policy.wait_s(0, {"retry-after-ms": "1500", "Retry-After": "9"}) == 1.5
    assert policy.wait_s(0, {"Retry-After": "2"}) == 2.0
    assert policy.wait_s(0, {"Retry-After": "0"}) == 0.2  # never under retry_after
    assert policy.wait_s(0, {"Retry-After": "3600"}) == min(MAX_WAIT_S, 30)
    assert RetryPolicy(timeout_s=5).wait_s(0, {"retry-after": "3600"}) == 5
    assert asked_wait_s({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0  # a date in the past
    assert asked_wait_s({"Retry-After": "soon"}) is None


def test_the_backoff_without_a_retry_after_grows_and_is_jittered() -> None:
    policy = RetryPolicy(num_retries=5)
    waits = [policy.wait_s(3, {}) for _ in range(50)]
    assert all(0 <= w <= 0.5 * 2 ** 3 for w in waits) and len(set(waits)) > 1


def test_a_deployments_keys_win_over_the_routers_over_litellms() -> None:
    config = Config.model_validate({"litellm_settings": {"num_retries": 1, "request_timeout": 40},
                                    "router_settings": {"retry_after": 2}, "ctxgate": {"upstream_timeout_s": 90}})
    assert retry_policy(config, "m", {}) == RetryPolicy(num_retries=1, min_wait_s=2, timeout_s=40)
    assert retry_policy(config, "m", {"num_retries": 0, "timeout": 5}) == RetryPolicy(0, 2, 5)
    routed = Config.model_validate({**config.model_dump(), "router_settings": {"num_retries": 3, "timeout": 20}})
    assert retry_policy(routed, "m", {}) == RetryPolicy(num_retries=3, min_wait_s=0, timeout_s=20)
    assert retry_policy(Config(), "m", {}) == RetryPolicy(num_retries=0, min_wait_s=0, timeout_s=600)
