"""One tenant's huge request holds no one else (issue 38): its CPU work runs off the event
loop, so /healthz and another tenant's small chats are answered while it is worked on; and
what one request may ask is capped per tenant (`max_messages`, `max_content_parts`): past a
cap, a 400 in the door's own error shape, with nothing logged and nothing forwarded.

A real `ctxgate serve` and the scripted upstream; orderings, never durations."""
from __future__ import annotations

import re
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest

from clients import assert_error_shape, post
from ctxgate.proxy.config import TenantConfig
from ctxgate.proxy.doors.caps import check_caps
from ctxgate.proxy.errors import GatewayError
from servers import ADMIN_KEY, KEYS, Gateway, launch, main_config, stop_all, wait_until
from upstream import ScriptedUpstream

BIG = 1_000_000
CAPPED_KEY = "sk-capped"
CAPS = {"max_messages": 3, "max_content_parts": 4}


def _config(upstream_url: str) -> dict[str, Any]:
    config = main_config(upstream_url, "auto")
    config["ctxgate"]["max_body_bytes"] = 64 * 1024 * 1024
    tenants = config["ctxgate"]["tenants"]
    tenants["acme"].update(max_messages=2 * BIG, max_content_parts=2 * BIG)  # the big one's tenant: caps raised
    tenants["capped"] = {"api_keys": [CAPPED_KEY], **CAPS}
    return config


@pytest.fixture(scope="module")
def fgw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = launch("fair-shares", Path(tmp_path_factory.mktemp("fair")), _config(upstream.url)).wait_ready()
    yield gw
    stop_all([gw])


def _counted_messages(gw: Gateway) -> float:
    """The messages the gateway began counting (`ctxgate_message_counts_total{source="counted"}`)."""
    status, text = gw.get("/metrics", {"Authorization": f"Bearer {ADMIN_KEY}"})
    assert status == 200
    found = re.search(r'^ctxgate_message_counts_total\{source="counted"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.timeout(1200)  # a million messages read, counted and compacted on a loaded 2-core machine: minutes
def test_a_huge_request_holds_neither_healthz_nor_another_tenant(fgw: Gateway, up: ScriptedUpstream) -> None:
    big = {"model": "gpt-4o", "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"}
                                           for i in range(BIG)]}
    raw = orjson.dumps(big)
    del big
    before = _counted_messages(fgw)
    answered: list[int] = []

    def send_big() -> None:
        resp = httpx.post(fgw.url + "/chat/completions", content=raw, timeout=900,
                          headers={"Authorization": f"Bearer {KEYS['acme']}", "Content-Type": "application/json",
                                   "X-Ctx-Session": f"big-{uuid.uuid4().hex[:8]}"})
        answered.append(resp.status_code)

    sender = threading.Thread(target=send_big)
    sender.start()
    try:
        # The gateway has parsed, validated and fingerprinted it, and now counts and plans it.
        wait_until(lambda: _counted_messages(fgw) >= before + BIG, 600, "the big request to be worked on")
        small: list[int] = []
        for i in range(4):
            status, health = fgw.get("/healthz")
            assert status == 200, health
            resp = post(fgw, {"model": "gpt-4o", "messages": [{"role": "user", "content": f"ping {i}"}]},
                        key=KEYS["relay"], headers={"X-Ctx-Session": f"small-{uuid.uuid4().hex[:8]}"})
            assert resp.status_code == 200, resp.text[:300]
            small.append(len(up.chats()))
    finally:
        sender.join(900)
    assert answered == [200]
    sizes = [len(r.body["messages"]) for r in up.chats()]
    # Every small chat reached the upstream and was answered before the big one got there.
    assert sizes[:4] == [1, 1, 1, 1] and len(sizes) == 5 and sizes[4] > 1, sizes
    assert small == [1, 2, 3, 4]


def _chat(n: int, parts: int = 0) -> tuple[str, dict[str, Any]]:
    content: Any = [{"type": "text", "text": "hi"}] * parts if parts else "hi"
    return "/v1/chat/completions", {"model": "gpt-4o", "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": content} for i in range(n)]}


def _messages(n: int, parts: int = 0) -> tuple[str, dict[str, Any]]:
    content: Any = [{"type": "text", "text": "hi"}] * parts if parts else "hi"
    return "/v1/messages", {"model": "gpt-4o", "max_tokens": 16, "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": content} for i in range(n)]}


def _responses(n: int, parts: int = 0) -> tuple[str, dict[str, Any]]:
    content: Any = [{"type": "input_text", "text": "hi"}] * parts if parts else "hi"
    return "/v1/responses", {"model": "gpt-4o", "input": [
        {"role": "user", "content": content} for _ in range(n)]}


def _refused_shape(door: str, resp: httpx.Response, code: str) -> str:
    """The error's message, checked to be in the door's own shape."""
    if door == "messages":  # Anthropic's
        assert resp.status_code == 400, resp.text[:300]
        body = resp.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return str(body["error"]["message"])
    return str(assert_error_shape(resp, 400, code)["message"])


@pytest.mark.parametrize("door", ["chat", "messages", "responses"])
def test_the_caps_refuse_in_the_doors_shape_and_change_nothing(fgw: Gateway, up: ScriptedUpstream,
                                                               door: str) -> None:
    build = {"chat": _chat, "messages": _messages, "responses": _responses}[door]
    sid = f"capped-{door}-{uuid.uuid4().hex[:8]}"
    headers = {"X-Ctx-Session": sid}
    path, body = build(CAPS["max_messages"] + 1)
    resp = post(fgw, body, key=CAPPED_KEY, path=path, headers=headers)
    message = _refused_shape(door, resp, "too_many_messages")
    assert "max_messages" in message and str(CAPS["max_messages"]) in message
    path, body = build(2, parts=3)  # 6 parts, over 4
    resp = post(fgw, body, key=CAPPED_KEY, path=path, headers=headers)
    message = _refused_shape(door, resp, "too_many_content_parts")
    assert "max_content_parts" in message and str(CAPS["max_content_parts"]) in message
    assert up.log == []
    assert fgw.data_dir is not None and not list(fgw.data_dir.rglob(f"*{sid}*"))
    # At the caps, the same tenant and session are served and logged: what was checked above can fail.
    path, body = build(1, parts=CAPS["max_content_parts"]) if door != "responses" else build(2, parts=2)
    resp = post(fgw, body, key=CAPPED_KEY, path=path, headers=headers)
    assert resp.status_code == 200, resp.text[:300]
    assert len(up.log) == 1 and list(fgw.data_dir.rglob(f"*{sid}*"))


@pytest.mark.parametrize("cap", [1, 4, 1000])
def test_a_body_too_small_to_hold_more_parts_than_the_cap_is_not_counted_and_one_that_can_is(cap: int) -> None:
    """The parts cap skips counting a body under twice the cap's bytes (`check_caps`): the
    tightest JSON of cap + 1 parts, one-byte values, is refused all the same."""
    limits = TenantConfig(max_content_parts=cap)
    for parts in (cap, cap + 1):
        raw = orjson.dumps({"messages": [{"role": "user", "content": [1] * parts}]})
        body = orjson.loads(raw)
        if parts <= cap:
            check_caps(limits, body["messages"], "messages", len(raw))
        else:
            with pytest.raises(GatewayError, match="max_content_parts"):
                check_caps(limits, body["messages"], "messages", len(raw))
    # The bound at its edge: a list of n one-byte values is 2n - 1 bytes (n values, n - 1 commas).
    assert len(orjson.dumps([1] * (cap + 1))) - 2 == 2 * (cap + 1) - 1
