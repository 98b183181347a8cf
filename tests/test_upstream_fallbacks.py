"""Fallbacks from LiteLLM's config keys, through the real gateway and the official SDKs: a
model that fails before any byte of its reply (after its own retries) hands the turn to the
next model group the config names; a turn that cannot fit its model even after compaction
goes to a larger one (`context_window_fallbacks`). The client sees the fallback's reply, the
`X-Ctx-Fallback` header names it, the WAL's RESPONSE records which model answered, and
`/metrics` counts it."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from clients import KEYS, MESSAGES, assert_error_shape, client, post
from ctxgate.wal.paths import WalPaths
from ctxgate.wal.reader import scan_file
from servers import METRICS_HEADERS, UPSTREAM_KEY, Gateway, launch, main_config, run_ctxgate, stop_all
from upstream import ScriptedUpstream


def fallback_config(upstream_url: str) -> dict[str, Any]:
    config = main_config(upstream_url, "auto")
    base = f"{upstream_url}/v1"

    def entry(name: str, model: str, limit: int = 100_000, **params: Any) -> dict[str, Any]:
        return {"model_name": name, "model_info": {"max_input_tokens": limit},
                "litellm_params": {"model": f"openai/{model}", "api_base": base, "api_key": UPSTREAM_KEY, **params}}

    config["model_list"] += [
        entry("primary", "error-503"), entry("refusing", "error-400"), entry("backup", "gpt-4o"),
        entry("chain", "error-503"), entry("second", "error-500", num_retries=0),
        entry("narrow", "gpt-4o", limit=400), entry("narrow-alone", "gpt-4o", limit=400),
        entry("wide", "gpt-4o-tools"),
    ]
    config["router_settings"] = {
        "num_retries": 1, "retry_after": 0,
        "fallbacks": [{"primary": ["backup"]}, {"refusing": ["backup"]}, {"chain": ["second", "backup"]}],
        "context_window_fallbacks": [{"narrow": ["wide"]}]}
    return config


@pytest.fixture(scope="module")
def fgw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = launch("fallbacks", Path(tmp_path_factory.mktemp("fallbacks")), fallback_config(upstream.url)).wait_ready()
    yield gw
    stop_all([gw])


def session() -> str:
    return f"fb-{uuid.uuid4().hex[:12]}"


def messages() -> list[dict[str, Any]]:
    return [*MESSAGES[:-1], {"role": "user", "content": f"Hello {uuid.uuid4().hex}"}]


def upstream_models(up: ScriptedUpstream) -> list[str]:
    return [r.body["model"] for r in up.log if isinstance(r.body, dict) and "model" in r.body]


def responses(gw: Gateway, sid: str) -> list[dict[str, Any]]:
    assert gw.data_dir is not None
    path = WalPaths(gw.data_dir).live("acme", sid)
    return [e for e in scan_file(path).events if e.get("type") == "RESPONSE"]


def fallbacks_counted(gw: Gateway, model: str, fallback: str, reason: str) -> float:
    text = httpx.get(gw.base + "/metrics", headers=METRICS_HEADERS, timeout=10).text
    wanted = f'ctxgate_upstream_fallbacks_total{{fallback="{fallback}",model="{model}",reason="{reason}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted))


def test_a_failing_model_hands_the_turn_to_its_fallback(fgw: Gateway, up: ScriptedUpstream) -> None:
    sid, before, sent = session(), fallbacks_counted(fgw, "primary", "backup", "503"), messages()
    raw = client(fgw).chat.completions.with_raw_response.create(
        model="primary", messages=sent, extra_headers={"X-Ctx-Session": sid})  # type: ignore[arg-type]
    assert raw.parse().choices[0].message.content == "ok"
    assert raw.headers["x-ctx-fallback"] == "backup"
    assert upstream_models(up) == ["error-503", "error-503", "gpt-4o"]  # its one retry, then the fallback
    assert [e["model"] for e in responses(fgw, sid)] == ["backup"]
    # The first attempt, counted beside its call, is logged before the fallback's attempt plans
    # the session: each message once, and the reply reports the count.
    assert fgw.data_dir is not None
    logged = [e for e in scan_file(WalPaths(fgw.data_dir).live("acme", sid)).events
              if e.get("type") in ("USER_INPUT", "TOOL_RESULT")]
    assert len(logged) == sum(m["role"] in ("user", "tool") for m in sent)
    assert int(raw.headers["x-ctx-tokens-in"]) > 0
    assert fallbacks_counted(fgw, "primary", "backup", "503") == before + 1


def test_a_stream_falls_back_before_its_first_byte(fgw: Gateway, up: ScriptedUpstream) -> None:
    sid = session()
    chunks = list(client(fgw).chat.completions.create(model="primary", messages=messages(),  # type: ignore
                                                      stream=True, extra_headers={"X-Ctx-Session": sid}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"
    assert upstream_models(up)[-1] == "gpt-4o" and [e["model"] for e in responses(fgw, sid)] == ["backup"]


def test_fallbacks_are_tried_in_order(fgw: Gateway, up: ScriptedUpstream) -> None:
    raw = client(fgw).chat.completions.with_raw_response.create(model="chain", messages=messages())  # type: ignore
    assert raw.headers["x-ctx-fallback"] == "backup"
    assert upstream_models(up) == ["error-503", "error-503", "error-500", "gpt-4o"]


def test_the_requests_own_error_is_not_a_reason_to_fall_back(fgw: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.BadRequestError):
        client(fgw).chat.completions.create(model="refusing", messages=messages())  # type: ignore[arg-type]
    assert upstream_models(up) == ["error-400"]


def test_a_turn_too_large_for_its_model_goes_to_the_larger_one(fgw: Gateway, up: ScriptedUpstream) -> None:
    big = [{"role": "user", "content": "Summarise this design note. " + "The gateway keeps the prefix. " * 200}]
    sid = session()
    raw = client(fgw).chat.completions.with_raw_response.create(
        model="narrow", messages=big, extra_headers={"X-Ctx-Session": sid})  # type: ignore[arg-type]
    assert raw.headers["x-ctx-fallback"] == "wide" and upstream_models(up) == ["gpt-4o-tools"]
    assert [e["model"] for e in responses(fgw, sid)] == ["wide"]
    assert fallbacks_counted(fgw, "narrow", "wide", "context_window") >= 1
    # The same turn for a model with no larger fallback: refused before anything is sent.
    resp = post(fgw, {"model": "narrow-alone", "messages": big})
    assert_error_shape(resp, 400, "context_exhausted")
    assert upstream_models(up) == ["gpt-4o-tools"]


def test_the_messages_door_falls_back_too(fgw: Gateway, up: ScriptedUpstream) -> None:
    claude = anthropic.Anthropic(base_url=fgw.base, api_key=KEYS["acme"], max_retries=0)
    reply = claude.messages.create(model="primary", max_tokens=64,
                                   messages=[{"role": "user", "content": f"hi {uuid.uuid4().hex}"}])
    assert reply.content[0].type == "text" and upstream_models(up)[-1] == "gpt-4o"


def test_a_fallback_to_a_model_the_config_lacks_is_refused_at_start(upstream: ScriptedUpstream,
                                                                   tmp_path: Path) -> None:
    config = main_config(upstream.url, "auto")
    config["router_settings"] = {"fallbacks": [{"gpt-4o": ["no-such-model"]}]}
    (tmp_path / "bad.yaml").write_text(json.dumps(config))
    done = run_ctxgate(["serve", "--config", str(tmp_path / "bad.yaml"), "--data-dir", str(tmp_path / "d")], tmp_path)
    assert done.returncode != 0 and "no-such-model" in done.stdout + done.stderr
