"""Slow and abusive clients over raw sockets: slowloris headers and bodies, idle connections,
connections past the cap, requests aiohttp's parser refuses, and who may read /metrics.

Timeouts are configured short (1-2 s); the tests assert that a connection was closed or
answered, never how fast.
"""
from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Iterator

import pytest

from servers import KEYS, Gateway, main_config, model_list, run_ctxgate, start_gateways, stop_all, wait_until
from upstream import ScriptedUpstream

from ctxgate.proxy.connections import RateLimitedLog

ADMIN_KEY = "sk-admin-0123456789abcdef"
CAP = 20
MARKER = "ZQXJ-ECHO-MARKER"


@pytest.fixture(scope="module")
def gateways(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Gateway]]:
    """`tight`: tenant keys, 1-2 s timeouts; `capped`: no tenants, at most CAP connections."""
    base = tmp_path_factory.mktemp("connections")
    tight = main_config(upstream.url, "auto", admin_key=ADMIN_KEY, connections={
        "header_read_timeout_s": 1, "body_read_timeout_s": 1, "keepalive_timeout_s": 2,
        "rejection_log_interval_s": 600})
    capped = {"model_list": model_list(upstream.url), "ctxgate": {"connections": {"max_connections": CAP}}}
    gws = start_gateways({"tight": (base / "tight", tight), "capped": (base / "capped", capped)})
    yield gws
    stop_all(gws.values())


@pytest.fixture
def tight(gateways: dict[str, Gateway]) -> Gateway:
    return gateways["tight"]


@pytest.fixture
def capped(gateways: dict[str, Gateway]) -> Gateway:
    return gateways["capped"]


def connect(gw: Gateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gw.port), timeout=20)


def closed_by_server(s: socket.socket, timeout: float = 20.0) -> bool:
    """Whether the server closes `s` (EOF or reset) within `timeout`, reading what it sends."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body: (status, lower-cased headers, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {buf!r}")
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def exchange(s: socket.socket, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    s.sendall(raw)
    return read_response(s)


def get(path: str, *extra: str) -> bytes:
    return "\r\n".join([f"GET {path} HTTP/1.1", "Host: ctxgate", *extra, "", ""]).encode()


def trickle(s: socket.socket, data: bytes, every_s: float) -> bool:
    """Send `data` a byte at a time; True if the server closed the connection before the end."""
    for i in range(len(data)):
        try:
            s.sendall(data[i:i + 1])
        except OSError:
            return True
        time.sleep(every_s)
    return False


# -- timeouts ----------------------------------------------------------------------------

def test_headers_trickled_a_byte_at_a_time_are_cut_off(tight: Gateway) -> None:
    headers = get("/v1/models", *(f"X-Pad-{i}: {'p' * 20}" for i in range(40)))
    with connect(tight) as s:
        assert trickle(s, headers, 0.5) or closed_by_server(s, 0.1), "the slowloris client got its headers through"


def test_a_connection_that_sends_nothing_is_closed(tight: Gateway) -> None:
    with connect(tight) as s:
        assert closed_by_server(s)


def test_a_body_trickled_a_byte_at_a_time_is_answered_408_and_closed(tight: Gateway) -> None:
    body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * 200}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: ctxgate\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with connect(tight) as s:
        s.sendall(head)
        trickle(s, body[:3], 0.5)
        status, headers, answer = read_response(s)
        assert status == 408
        assert json.loads(answer)["error"]["code"] == "body_timeout"
        assert headers.get("connection") == "close"
        assert closed_by_server(s)
    assert "Traceback" not in tight.text()


def test_a_body_shorter_than_its_content_length_is_not_waited_for(tight: Gateway) -> None:
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: ctxgate\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode()
    with connect(tight) as s:
        status, _, answer = exchange(s, head)
        assert status == 408 and json.loads(answer)["error"]["type"] == "invalid_request_error"


def test_an_idle_keep_alive_connection_is_closed(tight: Gateway) -> None:
    with connect(tight) as s:
        status, headers, _ = exchange(s, get("/healthz"))
        assert status == 200 and headers.get("connection") != "close"
        assert closed_by_server(s)


def test_requests_in_turn_on_one_connection_are_each_answered(tight: Gateway) -> None:
    with connect(tight) as s:
        for _ in range(3):
            assert exchange(s, get("/healthz"))[0] == 200


# -- the connection cap ------------------------------------------------------------------

def test_past_the_cap_health_checks_and_live_connections_still_answer(capped: Gateway) -> None:
    live = [connect(capped) for _ in range(CAP)]
    overflow: list[socket.socket] = []
    try:
        for s in live:  # each answered, then idle in keep-alive: all CAP are open
            assert exchange(s, get("/healthz"))[0] == 200
        for path in ("/healthz", "/readyz"):
            with connect(capped) as fresh:
                status, headers, body = exchange(fresh, get(path))
                assert (status, headers.get("connection")) == (200, "close"), body
        with connect(capped) as fresh:
            status, headers, body = exchange(fresh, get("/v1/models"))
            assert status == 503 and headers.get("retry-after") == "1"
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            assert closed_by_server(fresh)
        status, _, body = exchange(live[0], get("/v1/models"))
        assert status == 200 and json.loads(body)["object"] == "list"
        # Past the cap and the overflow kept for health checks, a connection is reset at once.
        overflow = [connect(capped) for _ in range(16)]
        wait_until(lambda: "ctxgate_connections_overflow_open 16.0" in exchange(live[1], get("/metrics"))[2].decode(),
                   what="16 connections past the cap")
        with connect(capped) as beyond:
            assert closed_by_server(beyond)
    finally:
        for s in live + overflow:
            s.close()
    wait_until(lambda: models_answered(capped), what="the cap to free up once the clients let go")


def models_answered(gw: Gateway) -> bool:
    try:
        return gw.get("/v1/models")[0] == 200
    except OSError:  # reset at accept: the gateway has not yet seen every client go
        return False


# -- what aiohttp's parser refuses ---------------------------------------------------------

PARSER_CASES = {
    "line_too_long": get("/healthz", f"X-Big: {MARKER}{'a' * 9000}"),
    "invalid_url": f"GET /{MARKER}/héllo HTTP/1.1\r\nHost: ctxgate\r\n\r\n".encode(),
    "invalid_request_line": get(f"/{MARKER} with spaces"),
    "invalid_header": get("/healthz", f"X-Ctl: {MARKER}\x01bell"),
    "invalid_content_length": (f"POST /v1/chat/completions HTTP/1.1\r\nHost: ctxgate\r\n"
                               f"Content-Length: {MARKER}\r\n\r\n").encode(),
    "invalid_content_encoding": (f"POST /v1/chat/completions HTTP/1.1\r\nHost: ctxgate\r\nAuthorization: Bearer "
                                 f"{KEYS['acme']}\r\nContent-Length: {len(MARKER)}\r\nContent-Encoding: gzip\r\n"
                                 f"\r\n{MARKER}").encode(),
}


@pytest.mark.parametrize("code", list(PARSER_CASES))
def test_a_request_the_parser_refuses_is_a_json_400_logged_once(tight: Gateway, code: str) -> None:
    for _ in range(3):
        with connect(tight) as s:
            status, headers, body = exchange(s, PARSER_CASES[code])
            assert closed_by_server(s)
        assert status == 400 and headers["content-type"].startswith("application/json")
        error = json.loads(body)["error"]
        assert error == {"message": error["message"], "type": "invalid_request_error", "param": None, "code": code}
        assert MARKER not in body.decode() and len(body) < 400
    def logged() -> list[str]:
        return [line for line in tight.text().splitlines() if f": {code} (" in line]

    wait_until(logged, what=f"the log line for {code}")
    time.sleep(0.2)  # the later two, were they logged, would be written by now
    lines = logged()
    assert len(lines) == 1 and "WARNING" in lines[0] and len(lines[0]) < 400
    assert "Traceback" not in tight.text()
    with connect(tight) as s:  # and the gateway serves on
        assert exchange(s, get("/healthz"))[0] == 200


def test_an_unread_body_that_does_not_decode_logs_no_traceback(tight: Gateway) -> None:
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: ctxgate\r\nContent-Length: {len(MARKER)}\r\n"
           f"Content-Encoding: gzip\r\n\r\n{MARKER}").encode()
    with connect(tight) as s:
        status, _, body = exchange(s, raw)  # refused (no key) before the body is read
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert closed_by_server(s)
    assert "Traceback" not in tight.text() and "Unhandled exception" not in tight.text()


def test_the_rejection_log_counts_what_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    rate_limited = RateLimitedLog(logging.getLogger("test.rejections"), interval_s=0.2)
    with caplog.at_level(logging.WARNING, "test.rejections"):
        for _ in range(5):
            rate_limited.warning("kind", "bad request")
        time.sleep(0.3)
        rate_limited.warning("kind", "bad request")
        rate_limited.warning("other", "other request")
    assert [r.getMessage() for r in caplog.records] == [
        "bad request", "bad request (4 more of this kind in the last 0 s)", "other request"]


# -- /metrics ------------------------------------------------------------------------------

@pytest.mark.parametrize("headers,status,code", [
    ({}, 401, "invalid_api_key"),
    ({"Authorization": "Bearer sk-not-a-key"}, 401, "invalid_api_key"),
    ({"Authorization": f"Bearer {KEYS['acme']}"}, 403, "admin_only"),  # gateway-wide series: the admin's
    ({"x-api-key": KEYS["locked"], "X-Ctx-Budget": "100"}, 403, "admin_only"),
    ({"Authorization": f"Bearer {ADMIN_KEY}"}, 200, None),
])
def test_metrics_need_the_admin_key_when_the_config_has_keys(tight: Gateway, headers: dict[str, str], status: int,
                                                             code: str | None) -> None:
    got, body = tight.get("/metrics", headers)
    assert got == status
    if status == 200:
        assert "ctxgate_connections_open" in body and "ctxgate_http_rejections" in body
    else:
        assert body["error"]["code"] == code


def test_metrics_are_open_without_tenant_keys(capped: Gateway) -> None:
    status, body = capped.get("/metrics")
    assert status == 200 and "ctxgate_connections_max 20.0" in body


@pytest.mark.parametrize("tenants", ["", "  tenants:\n    acme:\n      api_keys: [sk-acme]\n"],
                         ids=["no-key", "tenant-keys-only"])
def test_metrics_auth_key_without_the_admin_key_is_refused_at_start(tmp_path: Path, tenants: str) -> None:
    """Only the admin key reads /metrics: with tenant keys alone nobody could."""
    (tmp_path / "c.yaml").write_text("ctxgate:\n  metrics_auth: key\n" + tenants)
    done = run_ctxgate(["serve", "--config", str(tmp_path / "c.yaml"), "--port", "0"], tmp_path)
    assert done.returncode == 2 and "admin_key" in done.stderr
