"""Every number a client sends in a query parameter or a header, through a real gateway: only
ASCII digits in range pass; a superscript, another script's digit, a sign, spaces, an
underscore, a decimal point or a value too long to parse is a 400 in the door's error shape
naming the parameter, and changes nothing. And who reads /metrics: its series are the whole
gateway's, so the admin key does and a tenant key does not (docs/dashboard.md, Metrics)."""
from __future__ import annotations

import uuid
from typing import Any, Iterator

import httpx
import pytest

from clients import MESSAGES, assert_error_shape, post
from ctxgate.wal.paths import WalPaths
from servers import ADMIN_KEY, KEYS, Gateway, main_config, start_gateways, stop_all
from upstream import ScriptedUpstream

BAD = ["²", "٣", "５", "+5", " 5", "5 ", "5_0", "-1", "", "5.0", "1e3", "0x10", "5\n", "9" * 5000]
"""Refused wherever a number is read: `isdigit` or `int` alone take several of these."""
BAD_IN_A_HEADER = [v for v in BAD if v == v.strip()] + ["5 0"]
"""A header's value loses its surrounding whitespace on the wire (HTTP's optional
whitespace) and cannot hold a line break, so those are the query's cases; a space inside
the value is the header's."""
QUERIES = [("/v1/ctx/memory", "limit", KEYS["acme"]), ("/v1/ctx/dashboard/sessions", "limit", ADMIN_KEY),
           ("/v1/ctx/dashboard/sessions", "offset", ADMIN_KEY)]
DOORS = {"/v1/chat/completions": {"model": "gpt-4o", "messages": MESSAGES},
         "/v1/responses": {"model": "gpt-4o", "input": "Say hi."},
         "/v1/messages": {"model": "gpt-4o", "max_tokens": 50, "messages": [{"role": "user", "content": "Say hi."}]}}
METRIC = "ctxgate_requests_total"


@pytest.fixture(scope="module")
def gateways(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Gateway]]:
    """`main`: tenant keys, the admin key and memory; `keyless`: tenant keys and no admin key;
    `open`: tenant keys and the admin key with `metrics_auth: open`."""
    base = tmp_path_factory.mktemp("numeric")
    gws = start_gateways({
        "main": (base / "main", main_config(upstream.url, "auto", memory={"dream_model": "summarizer"})),
        "keyless": (base / "keyless", main_config(upstream.url, "auto", admin_key=None)),
        "open": (base / "open", main_config(upstream.url, "auto", metrics_auth="open"))})
    yield gws
    stop_all(gws.values())


@pytest.fixture
def gw(gateways: dict[str, Gateway]) -> Gateway:
    return gateways["main"]


def get(gw: Gateway, path: str, key: str | None, params: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(gw.base + path, params=params, headers={"Authorization": f"Bearer {key}"} if key else {},
                     timeout=30)


def seen_upstream(up: ScriptedUpstream, marker: str) -> bool:
    return any(marker in str(r.body) for r in up.log)


# -- query parameters -----------------------------------------------------------------------

@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("path, param, key", QUERIES)
def test_a_bad_number_in_the_query_is_a_400_naming_it(gw: Gateway, path: str, param: str, key: str,
                                                      value: str) -> None:
    before = get(gw, path, key).json()
    err = assert_error_shape(get(gw, path, key, {param: value}), 400, f"invalid_{param}")
    assert err["param"] == param and param in err["message"]
    assert get(gw, path, key).json() == before


def test_ascii_digits_in_range_pass(gw: Gateway) -> None:
    for i in range(3):
        made = httpx.post(gw.base + "/v1/ctx/memory", json={"category": "reference", "content": f"numeric-{i}"},
                          headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=30)
        assert made.status_code == 201, made.text
    page = get(gw, "/v1/ctx/memory", KEYS["acme"], {"limit": "002"}).json()
    assert len(page["data"]) == 2 and page["has_more"] is True
    listed = get(gw, "/v1/ctx/dashboard/sessions", ADMIN_KEY, {"limit": "0500", "offset": "0"}).json()
    assert (listed["limit"], listed["offset"]) == (500, 0)
    for path, param, key in QUERIES:  # the edges of the range: one past is refused
        high = 1000 if path == "/v1/ctx/memory" else 500 if param == "limit" else 450  # 500 less the page of 50
        low = 0 if param == "offset" else 1
        assert get(gw, path, key, {param: str(high)}).status_code == 200
        assert get(gw, path, key, {param: str(low)}).status_code == 200
        assert_error_shape(get(gw, path, key, {param: str(high + 1)}), 400, f"invalid_{param}")
        if low:
            assert_error_shape(get(gw, path, key, {param: str(low - 1)}), 400, f"invalid_{param}")


# -- headers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", BAD_IN_A_HEADER)
@pytest.mark.parametrize("path", DOORS)
def test_a_bad_budget_header_is_a_400_that_changes_nothing(gw: Gateway, up: ScriptedUpstream, path: str,
                                                           value: str) -> None:
    session = f"num-{uuid.uuid4().hex[:10]}"
    body: dict[str, Any] = {**DOORS[path]}
    marker = f"marker-{session}"
    if path == "/v1/responses":
        body["input"] = marker
    else:
        body["messages"] = [{"role": "user", "content": marker}]
    reply = post(gw, body, path=path, headers={"X-Ctx-Session": session,
                                                "X-Ctx-Budget": value.encode()})  # type: ignore[dict-item]
    assert reply.status_code == 400, reply.text[:300]
    if path == "/v1/messages":  # Anthropic's shape has no param: the message names it
        assert reply.json()["type"] == "error" and "X-Ctx-Budget" in reply.json()["error"]["message"]
    else:
        err = assert_error_shape(reply, 400, "invalid_header")
        assert err["param"] == "X-Ctx-Budget"
    assert not seen_upstream(up, marker)
    assert_error_shape(get(gw, f"/v1/ctx/sessions/{session}", KEYS["acme"]), 404, "session_not_found")
    assert gw.data_dir is not None and not WalPaths(gw.data_dir).live("acme", session).exists()


def test_a_good_budget_header_passes(gw: Gateway, up: ScriptedUpstream) -> None:
    session = f"num-{uuid.uuid4().hex[:10]}"
    reply = post(gw, DOORS["/v1/chat/completions"], headers={"X-Ctx-Session": session, "X-Ctx-Budget": "0050000"})
    assert reply.status_code == 200, reply.text[:300]
    assert get(gw, f"/v1/ctx/sessions/{session}", KEYS["acme"]).json()["turns"] == 1


# -- /metrics ---------------------------------------------------------------------------------

def test_metrics_are_the_admin_keys(gw: Gateway) -> None:
    assert post(gw, DOORS["/v1/chat/completions"]).status_code == 200  # a series to show
    shown = get(gw, "/metrics", ADMIN_KEY)
    assert shown.status_code == 200 and METRIC in shown.text
    for key in (KEYS["acme"], KEYS["locked"]):
        err = assert_error_shape(get(gw, "/metrics", key), 403, "admin_only")
        assert err["type"] == "permission_error" and "admin key" in err["message"] and METRIC not in str(err)
    for key in (None, "sk-not-a-key"):
        assert_error_shape(get(gw, "/metrics", key), 401, "invalid_api_key")
    # The same rule as the dashboard's own last hour.
    assert_error_shape(get(gw, "/v1/ctx/dashboard/metrics", KEYS["acme"]), 403, "admin_only")


def test_without_an_admin_key_a_tenant_key_is_told_how_to_read_metrics(gateways: dict[str, Gateway]) -> None:
    keyless = gateways["keyless"]
    err = assert_error_shape(get(keyless, "/metrics", KEYS["acme"]), 403, "admin_only")
    assert "ctxgate.admin_key" in err["message"] and "metrics_auth: open" in err["message"]
    assert_error_shape(get(keyless, "/metrics", None), 401, "invalid_api_key")


def test_metrics_auth_open_stays_open(gateways: dict[str, Gateway]) -> None:
    opened = gateways["open"]
    for key in (None, KEYS["acme"], ADMIN_KEY):
        got = get(opened, "/metrics", key)
        assert got.status_code == 200 and "ctxgate_connections_open" in got.text
