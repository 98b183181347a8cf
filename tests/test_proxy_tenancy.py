"""Tenants, sessions, the service endpoints, the demo model, and `ctxgate serve`
refusing a bad config."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
import yaml

from ctxgate.proxy.config import load_config
from clients import KEYS, MESSAGES, assert_error_shape, client, post
from servers import METRICS_HEADERS, UPSTREAM_KEY, Gateway, launch, model_list, run_ctxgate
from upstream import ScriptedUpstream

BODY = {"model": "gpt-4o", "messages": MESSAGES}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- tenants ----------------------------------------------------------------------------

@pytest.mark.parametrize("key", [None, "sk-wrong", "sk-acme-but-longer", ""])
def test_wrong_or_missing_key_is_401(gateway: Gateway, up: ScriptedUpstream, key: str | None) -> None:
    assert_error_shape(post(gateway, BODY, key=key), 401, "invalid_api_key")
    assert up.chats() == []


def test_sdk_sees_an_authentication_error(gateway: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(gateway, key="sk-wrong").chat.completions.create(model="gpt-4o", messages=MESSAGES)


def test_tenant_key_is_not_sent_upstream(gateway: Gateway, up: ScriptedUpstream) -> None:
    client(gateway).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    headers = up.chats()[-1].headers
    assert headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert not any(KEYS["acme"] in v for v in headers.values()), headers


def test_pass_through_key_is_sent_upstream(gateway: Gateway, up: ScriptedUpstream) -> None:
    client(gateway, key=KEYS["relay"]).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert up.chats()[-1].headers["authorization"] == f"Bearer {KEYS['relay']}"


def test_the_body_cannot_steer_the_upstream_call(gateway: Gateway, up: ScriptedUpstream) -> None:
    """Fields litellm would take as its own controls stay data: no redirect, no key, no headers."""
    elsewhere = ScriptedUpstream().start()
    try:
        steer = {"api_base": f"{elsewhere.url}/v1", "base_url": f"{elsewhere.url}/v1", "api_key": "sk-client",
                 "extra_headers": {"X-Injected": "1"}, "mock_response": "not from the upstream",
                 "custom_llm_provider": "anthropic", "max_retries": 5, "timeout": 0.001}
        resp = post(gateway, {**BODY, **steer})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == "ok"
        assert elsewhere.log == []
        (got,) = up.chats()
        assert got.headers["authorization"] == f"Bearer {UPSTREAM_KEY}" and "x-injected" not in got.headers
        # Passed through as the data they are; litellm drops the ones its config sets itself.
        data = {k: v for k, v in steer.items() if gateway.name == "auto" or k not in ("api_base", "api_key")}
        assert {k: got.body.get(k) for k in data} == data
    finally:
        elsewhere.stop()


def test_sessions_belong_to_their_tenant(gateway: Gateway, up: ScriptedUpstream) -> None:
    sid = f"tenant-iso-{gateway.name}"
    assert post(gateway, BODY, headers={"X-Ctx-Session": sid, "X-Ctx-Tenant": "relay"}).status_code == 200
    status, state = gateway.get(f"/v1/ctx/sessions/{sid}", _auth(KEYS["acme"]))
    assert status == 200 and state["tenant"] == "acme" and state["turns"] == 1  # the key decides, not X-Ctx-Tenant
    assert state["id"] == sid and state["records"] == [] and state["has_attempted_reactive_compact"] is False
    assert gateway.get(f"/v1/ctx/sessions/{sid}", _auth(KEYS["relay"]))[0] == 404
    assert gateway.get(f"/v1/ctx/sessions/{sid}")[0] == 401
    assert post(gateway, BODY, key=KEYS["relay"], headers={"X-Ctx-Session": sid}).status_code == 200
    assert gateway.get(f"/v1/ctx/sessions/{sid}", _auth(KEYS["relay"]))[1]["turns"] == 1
    assert gateway.get(f"/v1/ctx/sessions/{sid}", _auth(KEYS["acme"]))[1]["turns"] == 1
    assert gateway.get("/v1/ctx/sessions/..", _auth(KEYS["acme"]))[0] in (400, 404)


# -- session resolution -----------------------------------------------------------------

def _session(gw: Gateway, body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    resp = post(gw, body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-ctx-session"]


def test_session_fingerprint_follows_the_conversation(gateway: Gateway, up: ScriptedUpstream) -> None:
    first = _session(gateway, BODY)
    assert first.startswith("fp-")
    later = {**BODY, "messages": [*MESSAGES, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "?"}]}
    assert _session(gateway, later) == first  # same system prompt and first user message
    other = {**BODY, "messages": [MESSAGES[0], {"role": "user", "content": "a different task"}]}
    assert _session(gateway, other) != first


def test_session_from_other_conventions(gateway: Gateway, up: ScriptedUpstream) -> None:
    assert _session(gateway, BODY, {"x-session-id": "agent-run-1"}) == "agent-run-1"
    assert _session(gateway, BODY, {"x-session-affinity": "affinity-2"}) == "affinity-2"
    assert _session(gateway, {**BODY, "prompt_cache_key": "pck-3"}) == "pck-3"
    assert _session(gateway, {**BODY, "prompt_cache_key": "pck-3"}, {"X-Ctx-Session": "mine"}) == "mine"
    hashed = _session(gateway, BODY, {"x-session-id": "../not/a safe id"})
    assert hashed.startswith("h-") and "/" not in hashed
    assert up.chats()[-1].body.get("prompt_cache_key") is None
    assert [c.body.get("prompt_cache_key") for c in up.chats()][2] == "pck-3"  # passed through untouched


# -- service endpoints ------------------------------------------------------------------

def test_models_lists_the_model_list(gateway: Gateway) -> None:
    status, listing = gateway.get("/v1/models")
    assert status == 200 and listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == [m["model_name"] for m in model_list("http://x")]
    assert [m.id for m in client(gateway).models.list()] == [m["id"] for m in listing["data"]]


def test_health_and_readiness(gateway: Gateway) -> None:
    assert gateway.get("/healthz") == (200, {"status": "ok"})
    assert gateway.get("/readyz") == (200, {"status": "ready"})
    status, text = gateway.get("/metrics", METRICS_HEADERS)
    assert status == 200 and "ctxgate_requests_total" in text


# -- the demo model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = launch("demo", tmp_path_factory.mktemp("demo"), None).wait_ready()
    yield gw
    gw.stop()


def test_demo_model_answers_without_config(demo: Gateway) -> None:
    assert "ctxgate-demo" in demo.text()
    assert [m["id"] for m in demo.get("/v1/models")[1]["data"]] == ["ctxgate-demo"]
    cli = openai.OpenAI(base_url=demo.url, api_key="anything", max_retries=0)
    raw = cli.chat.completions.with_raw_response.create(model="ctxgate-demo", messages=MESSAGES)
    reply = raw.parse()
    assert "received 4 messages" in (reply.choices[0].message.content or "")
    assert raw.headers["x-ctx-levels"] == "none" and int(raw.headers["x-ctx-tokens-in"]) > 0
    chunks = list(cli.chat.completions.create(model="ctxgate-demo", messages=MESSAGES, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage is not None
    with pytest.raises(openai.NotFoundError):
        cli.chat.completions.create(model="gpt-4o", messages=MESSAGES)


def test_an_open_gateway_takes_overrides_unless_its_tenant_config_says_otherwise(demo: Gateway) -> None:
    """No tenant keys: whoever reaches the gateway runs it, so X-Ctx-Budget and X-Ctx-Profile
    are taken unless a tenant's allow_overrides is set (a gateway with keys: see test_proxy_errors)."""
    cli = openai.OpenAI(base_url=demo.url, api_key="anything", max_retries=0)
    raw = cli.chat.completions.with_raw_response.create(
        model="ctxgate-demo", messages=MESSAGES, extra_headers={"X-Ctx-Budget": "100000", "X-Ctx-Profile": "minimal"})
    assert raw.http_response.status_code == 200


# -- a bad config is refused at start ---------------------------------------------------

GOOD_MODEL = {"model_name": "m", "litellm_params": {"model": "openai/m", "api_base": "http://127.0.0.1:9/v1"}}
BAD_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "unknown key": ({"ctxgate": {"stat": "memory"}}, "ctxgate.stat"),
    "bad profile": ({"ctxgate": {"profile": "maximal"}}, "ctxgate.profile"),
    "bad state": ({"ctxgate": {"state": "postgres://db"}}, "ctxgate.state"),
    "bad forwarding": ({"ctxgate": {"forwarding": "sometimes"}}, "ctxgate.forwarding"),
    "tenant profile": ({"ctxgate": {"tenants": {"acme": {"profile": "x"}}}}, "ctxgate.tenants.acme.profile"),
    "tenant path name": ({"ctxgate": {"tenants": {"../etc": {}}}}, "ctxgate.tenants"),
    "pipeline value": ({"ctxgate": {"pipeline": {"trigger_ratio": "high"}}}, "ctxgate.pipeline.trigger_ratio"),
    "pipeline key": ({"ctxgate": {"profiles": {"minimal": {"pipeline": {"snip": {"keep": 3}}}}}},
                     "ctxgate.profiles.minimal.pipeline.snip.keep"),
    "negative price": ({"ctxgate": {"pipeline": {"cost": {"prices": {"input": -1, "cache_read": 0.1,
                                                                      "cache_write": 1}}}}},
                       "ctxgate.pipeline.cost.prices.input"),
    "price not a number": ({"ctxgate": {"tenants": {"acme": {"pipeline": {"cost": {"prices": {
        "input": 1, "cache_read": "cheap", "cache_write": 1}}}}}}},
        "ctxgate.tenants.acme.pipeline.cost.prices.cache_read"),
    "no litellm model": ({"model_list": [{"model_name": "m", "litellm_params": {"api_base": "x"}}]},
                         "model_list.0.litellm_params"),
    "max body": ({"model_list": [GOOD_MODEL], "ctxgate": {"max_body_bytes": -1}}, "ctxgate.max_body_bytes"),
    "tokenizer": ({"model_list": [GOOD_MODEL], "ctxgate": {"tokenizers": [
        {"pattern": "m*", "tokenizer": "hf:/nonexistent/tokenizer.json"}]}}, "ctxgate.tokenizers"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_is_refused_naming_the_key(tmp_path: Path, case: str) -> None:
    config, key = BAD_CONFIGS[case]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    done = run_ctxgate(["serve", "--config", str(path), "--port", "9", "--data-dir", str(tmp_path / "d")], tmp_path)
    assert done.returncode != 0
    assert "refusing to start" in done.stderr and key in done.stderr, done.stderr[-2000:]


def test_a_retired_setting_is_dropped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`count_workers` (the count's worker processes, gone since gigatoken counts in a thread)
    in a config written for an earlier release: it starts, and says the setting does nothing."""
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"model_list": [GOOD_MODEL], "ctxgate": {"count_workers": 2, "profile": "minimal"}}))
    with caplog.at_level("WARNING", logger="ctxgate.config"):
        config = load_config(str(path))
    assert config.ctxgate.profile == "minimal" and "count_workers" not in config.ctxgate.model_dump()
    assert any("count_workers is ignored" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("text, what", [("model_list: [\n", "not valid YAML"), ("- 1\n- 2\n", "top level")])
def test_unreadable_config_is_refused(tmp_path: Path, text: str, what: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    done = run_ctxgate(["serve", "--config", str(path), "--port", "9"], tmp_path)
    assert done.returncode != 0 and what in done.stderr, done.stderr[-2000:]
    missing = run_ctxgate(["serve", "--config", str(tmp_path / "absent.yaml"), "--port", "9"], tmp_path)
    assert missing.returncode != 0 and "no such config file" in missing.stderr
