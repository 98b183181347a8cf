"""Errors: the upstream's keep their status and object, a dead upstream is 502, a slow
one 504, a client that leaves mid-stream cancels the upstream call, and bad input is a
4xx in OpenAI's shape, never a 500 (also under a fuzzer)."""
from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clients import KEYS, MESSAGES, TOOLS, assert_error_shape, client, post
from conftest import FORWARDING
from servers import Gateway, main_config, start_gateways, stop_all, wait_until
from upstream import ScriptedUpstream, error_object

BODY = {"model": "gpt-4o", "messages": MESSAGES}


@pytest.fixture(scope="module")
def timeout_gateways(upstream: ScriptedUpstream,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Gateway]]:
    """Gateways that give the upstream half a second to answer."""
    base = tmp_path_factory.mktemp("timeouts")
    gateways = start_gateways({f"timeout-{f}": (base / f, main_config(upstream.url, f, upstream_timeout_s=0.5))
                               for f in FORWARDING})
    yield gateways
    stop_all(gateways.values())


# -- upstream failures ------------------------------------------------------------------

@pytest.mark.parametrize("status", [429, 500, 503])
def test_upstream_error_keeps_status_and_object(gateway: Gateway, up: ScriptedUpstream, status: int) -> None:
    resp = post(gateway, {"model": f"error-{status}", "messages": MESSAGES},
                headers={"X-Ctx-Session": "err-session"})
    err = assert_error_shape(resp, status)
    assert resp.headers["x-ctx-session"] == "err-session"
    expected = error_object(status, f"scripted upstream error {status}", f"scripted_{status}")["error"]
    assert err["code"] == expected["code"] and err["type"] == expected["type"]
    assert expected["message"] in err["message"]
    assert len(up.chats()) == 1  # no retries behind the client's back: retrying is its choice
    if gateway.name == "auto":
        assert resp.json() == {"error": expected}


def test_upstream_rate_limit_reaches_the_sdk_as_such(gateway: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.RateLimitError) as caught:
        client(gateway).chat.completions.create(model="error-429", messages=MESSAGES)
    assert caught.value.status_code == 429 and caught.value.code == "scripted_429"


def test_an_unknown_model_name_is_not_echoed_whole(gateway: Gateway, up: ScriptedUpstream) -> None:
    err = assert_error_shape(post(gateway, {"model": "x" * 100_000, "messages": MESSAGES}), 404, "model_not_found")
    assert len(err["message"]) < 1000 and "100000 characters" in err["message"]


@pytest.mark.parametrize("text", [5, None, ["a"], {"a": 1}, True])
def test_a_text_part_whose_text_is_not_a_string_is_refused_before_anything(gateway: Gateway, up: ScriptedUpstream,
                                                                         text: Any) -> None:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    err = assert_error_shape(post(gateway, body, headers={"X-Ctx-Session": "bad-text-part"}), 400, "invalid_request")
    assert err["param"] == "messages.0.content.0.text" and up.chats() == []
    status, _ = gateway.get("/v1/ctx/sessions/bad-text-part", {"Authorization": f"Bearer {KEYS['acme']}"})
    assert status == 404  # no session was made for it


def test_unreachable_upstream_is_502(gateway: Gateway, up: ScriptedUpstream) -> None:
    err = assert_error_shape(post(gateway, {"model": "deadend", "messages": MESSAGES}), 502)
    assert err["code"] == "upstream_unreachable"


def test_context_exhausted_after_one_reactive_compaction(gateway: Gateway, up: ScriptedUpstream) -> None:
    resp = post(gateway, {"model": "overflow", "messages": MESSAGES}, headers={"X-Ctx-Session": f"of-{gateway.name}"})
    err = assert_error_shape(resp, 400, "context_exhausted")
    assert err["message"].startswith("CONTEXT_EXHAUSTED") and "after compaction" in err["message"]
    # The first try only: the refusal named the limit, the reactive compaction could not bring
    # the request under it, and what would be refused again is not sent (issue 36, item 8).
    assert len([c for c in up.chats() if c.body.get("model") == "overflow"]) == 1


@pytest.mark.parametrize("forwarding", FORWARDING)
def test_slow_upstream_is_504_and_is_cancelled(timeout_gateways: dict[str, Gateway], up: ScriptedUpstream,
                                               forwarding: str) -> None:
    gw = timeout_gateways[f"timeout-{forwarding}"]
    err = assert_error_shape(post(gw, {"model": "slow", "messages": MESSAGES}), 504)
    assert err["code"] == "upstream_timeout"
    wait_until(lambda: up.chats() and all(c.done for c in up.chats()), 10, "the upstream call to end")
    assert len(up.chats()) == 1 and up.chats()[0].cancelled  # ctxgate hung up rather than waiting the upstream out
    assert post(gw, BODY).status_code == 200


@pytest.mark.parametrize("forwarding", FORWARDING)
def test_stream_stalling_mid_way_ends_with_an_error_event(timeout_gateways: dict[str, Gateway], up: ScriptedUpstream,
                                                          forwarding: str) -> None:
    gw = timeout_gateways[f"timeout-{forwarding}"]
    resp = post(gw, {"model": "slow", "messages": MESSAGES, "stream": True})
    assert resp.status_code == 200  # the headers were gone when the upstream stalled
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "upstream_timeout", events


def test_client_disconnect_mid_stream_cancels_upstream(gateway: Gateway, up: ScriptedUpstream) -> None:
    stream = client(gateway).chat.completions.create(model="slow", messages=MESSAGES, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()
    wait_until(lambda: up.chats() and up.chats()[0].done, 10, "the upstream handler to end")
    assert up.chats()[0].cancelled
    assert client(gateway).chat.completions.create(model="gpt-4o", messages=MESSAGES).choices[0].message.content


# -- bad input --------------------------------------------------------------------------

BAD_BODIES: dict[str, Any] = {
    "missing model": {"messages": MESSAGES},
    "missing messages": {"model": "gpt-4o"},
    "empty messages": {"model": "gpt-4o", "messages": []},
    "messages not a list": {"model": "gpt-4o", "messages": "hello"},
    "model not a string": {"model": 42, "messages": MESSAGES},
    "empty model": {"model": "", "messages": MESSAGES},
    "unknown role": {"model": "gpt-4o", "messages": [{"role": "wizard", "content": "x"}]},
    "message not an object": {"model": "gpt-4o", "messages": ["hi"]},
    "content a number": {"model": "gpt-4o", "messages": [{"role": "user", "content": 7}]},
    "stream a string": {**BODY, "stream": "yes"},
    "n zero": {**BODY, "n": 0},
    "n a float": {**BODY, "n": 1.5},
    "tools not a list": {**BODY, "tools": {"type": "function"}},
    "tool message without id": {"model": "gpt-4o", "messages": [{"role": "tool", "content": "out"}]},
    "developer message without content": {"model": "gpt-4o", "messages": [{"role": "developer"}]},
    "user content null": {"model": "gpt-4o", "messages": [{"role": "user", "content": None}]},
    "tool_calls without function": {"model": "gpt-4o", "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]},
    "stream_options not an object": {**BODY, "stream": True, "stream_options": "usage"},
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_body_is_400(gateway: Gateway, up: ScriptedUpstream, case: str) -> None:
    resp = post(gateway, BAD_BODIES[case], headers={"X-Ctx-Session": "bad-input"})
    assert_error_shape(resp, (400, 422))
    assert up.chats() == []
    assert gateway.get("/v1/ctx/sessions/bad-input", {"Authorization": f"Bearer {KEYS['acme']}"})[0] == 404


@pytest.mark.parametrize("raw", [b'{"model": "gpt-4o", "messages": [', b"", b"[1, 2]", b'"text"', b"\xff\xfe{}",
                                 b"null", b'{"model": "gpt-4o", "messages": [{"role": "user", "content": NaN}]}'])
def test_invalid_json_is_400(gateway: Gateway, up: ScriptedUpstream, raw: bytes) -> None:
    assert_error_shape(post(gateway, raw=raw), 400, "invalid_json")


def test_body_over_the_limit_is_413(gateway: Gateway, up: ScriptedUpstream) -> None:
    huge = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * 1_200_000}]}
    assert_error_shape(post(gateway, huge), 413, "request_too_large")
    assert up.chats() == []


def test_unknown_model_is_404(gateway: Gateway, up: ScriptedUpstream) -> None:
    err = assert_error_shape(post(gateway, {"model": "gpt-17", "messages": MESSAGES}), 404, "model_not_found")
    assert err["param"] == "model" and "gpt-4o" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client(gateway).chat.completions.create(model="gpt-17", messages=MESSAGES)


@pytest.mark.parametrize("header, value, status, code", [
    ("X-Ctx-Session", "../../etc/passwd", 400, "invalid_session"),
    ("X-Ctx-Session", "a" * 129, 400, "invalid_session"),
    ("X-Ctx-Session", "has space", 400, "invalid_session"),
    ("X-Ctx-Budget", "lots", 400, "invalid_header"),
    ("X-Ctx-Budget", "0", 400, "invalid_header"),
    ("X-Ctx-Budget", "-5", 400, "invalid_header"),
    ("X-Ctx-Budget", "1e6", 400, "invalid_header"),
    ("X-Ctx-Budget", "999999999999", 400, "invalid_header"),
    ("X-Ctx-Profile", "maximal", 400, "invalid_header"),
])
def test_bad_ctx_header_is_400(gateway: Gateway, up: ScriptedUpstream, header: str, value: str, status: int,
                               code: str) -> None:
    err = assert_error_shape(post(gateway, BODY, headers={header: value}), status, code)
    assert err["param"] == header
    assert up.chats() == []


def test_overrides_the_tenant_may_not_make_are_403(gateway: Gateway, up: ScriptedUpstream) -> None:
    for header, value in (("X-Ctx-Budget", "5000"), ("X-Ctx-Profile", "minimal")):
        resp = post(gateway, BODY, headers={header: value}, key=KEYS["locked"])
        assert_error_shape(resp, 403, "override_not_allowed")
    # A malformed override is a bad request whoever sends it: 400 before the permission.
    for header, value in (("X-Ctx-Budget", "lots"), ("X-Ctx-Profile", "maximal")):
        assert_error_shape(post(gateway, BODY, headers={header: value}, key=KEYS["locked"]), 400, "invalid_header")
    assert post(gateway, BODY, headers={"X-Ctx-Budget": "50000", "X-Ctx-Profile": "minimal"}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_tenant_body_limit_is_a_413_that_changes_nothing(gateway: Gateway, up: ScriptedUpstream, path: str) -> None:
    from servers import LOCKED_BODY_BYTES

    session = f"limit-{uuid.uuid4().hex[:8]}"
    text = "x" * LOCKED_BODY_BYTES
    body = {"model": "gpt-4o", "max_tokens": 16, **({"input": text} if path == "/v1/responses" else
                                                     {"messages": [{"role": "user", "content": text}]})}
    headers = {"X-Ctx-Session": session, "x-api-key": KEYS["locked"], "anthropic-version": "2023-06-01"}
    resp = post(gateway, body, headers=headers, key=KEYS["locked"], path=path)
    assert resp.status_code == 413 and "tenant's limit of 4096 bytes" in resp.text
    assert up.chats() == [] and not up.log
    status, _ = gateway.get(f"/v1/ctx/sessions/{session}", {"Authorization": f"Bearer {KEYS['locked']}"})
    assert status == 404
    small = {**body, **({"input": "hi"} if path == "/v1/responses" else
                        {"messages": [{"role": "user", "content": "hi"}]})}
    assert post(gateway, small, headers=headers, key=KEYS["locked"], path=path).status_code == 200


def test_unknown_routes_and_methods_keep_the_error_shape(gateway: Gateway) -> None:
    assert_error_shape(httpx.get(gateway.base + "/v1/nothing-here"), 404)
    assert_error_shape(httpx.get(gateway.url + "/chat/completions"), 405)
    assert_error_shape(httpx.get(gateway.url + "/ctx/sessions/..%2Fetc",
                                 headers={"Authorization": f"Bearer {KEYS['acme']}"}), (400, 404))


# -- the fuzzer -------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
TEXT = st.text(max_size=40)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"])
CALL = st.fixed_dictionaries({"id": TEXT | JSON, "type": st.just("function") | JSON,
                              "function": st.fixed_dictionaries({"name": TEXT | JSON,
                                                                 "arguments": TEXT | JSON}) | JSON})
MESSAGE = st.fixed_dictionaries({"role": ROLES | JSON}, optional={
    "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT | JSON}),
                               max_size=2) | JSON,
    "name": TEXT | JSON, "tool_call_id": TEXT | JSON, "tool_calls": st.lists(CALL, max_size=2) | JSON})
BODIES = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["gpt-4o", "gpt-4o-tools", "mystery-model", "no-such-model"]) | JSON,
    "messages": st.lists(MESSAGE, min_size=1, max_size=4) | st.lists(MESSAGE | JSON, max_size=3) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON}) | JSON,
    "n": st.integers(-1, 3) | JSON, "tools": st.lists(st.just(TOOLS[0]) | JSON, max_size=2) | JSON,
    "prompt_cache_key": TEXT | JSON, "user": TEXT | JSON, "stop": TEXT | JSON, "x_custom": JSON}) | JSON
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=140).map(str.strip)
HEADERS = st.fixed_dictionaries({}, optional={
    "X-Ctx-Session": HEADER_TEXT, "X-Ctx-Budget": HEADER_TEXT | st.integers(-5, 10**9).map(str),
    "X-Ctx-Profile": st.sampled_from(["minimal", "professional", "enterprise"]) | HEADER_TEXT,
    "x-session-id": HEADER_TEXT, "Authorization": st.sampled_from(["Bearer sk-acme", "Bearer sk-nope", "", "Basic x"])})


def _check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code == 200:
        if resp.headers["content-type"].startswith("text/event-stream"):
            assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-300:]
        else:
            assert resp.json()["choices"], resp.text[:300]
    else:
        assert_error_shape(resp, resp.status_code)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=BODIES, headers=HEADERS)
def test_fuzzed_requests_never_500(gateway: Gateway, body: Any, headers: dict[str, str]) -> None:
    sent = {"Authorization": "Bearer sk-acme", "Content-Type": "application/json", **headers}
    _check(httpx.post(gateway.url + "/chat/completions", content=json.dumps(body).encode(), headers=sent, timeout=30))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_fuzzed_bytes_never_500(gateway: Gateway, raw: bytes) -> None:
    _check(post(gateway, raw=raw))



def test_the_upstreams_retry_and_rate_limit_headers_reach_the_client(gateway: Gateway, up: ScriptedUpstream) -> None:
    """A 429's `retry-after` tells the SDK when to retry (without it, it retries sooner than the
    provider asked); `x-ratelimit-*` and the provider's request id come with every reply."""
    with pytest.raises(openai.RateLimitError) as e:
        client(gateway).chat.completions.create(model="error-429", messages=MESSAGES)
    assert e.value.response.headers["retry-after"] == "1"
    assert e.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    raw = client(gateway).chat.completions.with_raw_response.create(model="gpt-4o", messages=MESSAGES)
    raw.parse()
    if gateway.name == "auto":  # through litellm a reply is rebuilt from its objects, without the headers
        assert raw.headers["x-request-id"] == "req_scripted" and raw.headers["x-ratelimit-remaining-requests"] == "99"


# -- transports ctxgate does not serve --------------------------------------------------

@pytest.mark.parametrize("method, path", [("GET", "/v1/responses"), ("GET", "/v1/chat/completions"),
                                          ("POST", "/v1/responses")])
def test_a_websocket_upgrade_gets_a_clear_error_at_once(gateway: Gateway, up: ScriptedUpstream, method: str,
                                                        path: str) -> None:
    """Codex tries the Responses API over a WebSocket first: a clear 400 it falls back on, never
    a hang and never anything forwarded."""
    before = len(up.log)
    headers = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Authorization": f"Bearer {KEYS['acme']}"}
    resp = httpx.request(method, gateway.base + path, headers=headers, timeout=30)
    err = assert_error_shape(resp, 400, "websocket_unsupported")
    assert "HTTP" in err["message"] and path in err["message"]
    assert len(up.log) == before
