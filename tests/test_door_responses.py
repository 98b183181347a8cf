"""The OpenAI Responses door, driven by the official `openai` SDK over real sockets: a real
`ctxgate serve` in front of the scripted upstream, which stores nothing (it refuses any
`previous_response_id`), so every chain that works was resolved by ctxgate."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from servers import KEYS, Gateway, RedisServer, launch, main_config, start_gateways, stop_all
from upstream import ScriptedUpstream

AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}
TOOLS = [{"type": "function", "name": "shell", "description": "run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses-door")


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, workdir: Path) -> Iterator[Gateway]:
    gateway = launch("responses", workdir, main_config(upstream.url, "auto")).wait_ready()
    yield gateway
    stop_all([gateway])


def client(gw: Gateway, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url, api_key=KEYS["acme"], max_retries=0, **kw)


def session() -> dict[str, str]:
    return {"X-Ctx-Session": f"resp-{uuid.uuid4().hex[:12]}"}


def sent(up: ScriptedUpstream, model: str = "gpt-4o") -> list[dict[str, Any]]:
    return [r.body for r in up.log if r.door == "responses" and r.body.get("model") == model]


def test_plain_reply_is_the_upstream_response(gw: Gateway, up: ScriptedUpstream) -> None:
    seen: list[httpx.Request] = []
    cli = client(gw, http_client=httpx.Client(event_hooks={"request": [seen.append]}))
    r = cli.responses.create(model="gpt-4o", input="hi", instructions="be brief", extra_headers=session(),
                             extra_body={"future_field": {"b": 1, "a": [2.50, None]}})
    assert r.output_text == "ok" and r.id.startswith("resp_up")
    [entry] = [e for e in up.log if e.door == "responses"]
    # Nothing to compact, add or chain: the upstream gets the client's own bytes.
    assert entry.raw == seen[0].content
    assert entry.body["instructions"] == "be brief" and entry.body["input"] == "hi"
    assert "previous_response_id" not in entry.body


def test_stream_relays_the_events_and_keeps_the_response(gw: Gateway, up: ScriptedUpstream) -> None:
    cli = client(gw)
    events = list(cli.responses.create(model="gpt-4o", input=[{"role": "user", "content": "hi"}], stream=True,
                                       extra_headers=session()))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    final = events[-1].response  # type: ignore[union-attr]
    assert cli.responses.retrieve(final.id).output_text == "ok"


def test_function_call_round_trip_through_previous_response_id(gw: Gateway, up: ScriptedUpstream) -> None:
    cli, headers = client(gw), session()
    first = cli.responses.create(model="gpt-4o-tools", input="list the files", tools=TOOLS,  # type: ignore[arg-type]
                                 extra_headers=headers)
    [call] = [o for o in first.output if o.type == "function_call"]
    second = cli.responses.create(model="gpt-4o", previous_response_id=first.id, tools=TOOLS,  # type: ignore[arg-type]
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": "a.py b.py"}], extra_headers=headers)
    assert second.output_text == "ok"
    body = sent(up)[-1]
    kinds = [(i.get("type"), i.get("call_id")) for i in body["input"]]
    assert kinds == [(None, None), ("function_call", call.call_id), ("function_call_output", call.call_id)]
    assert body["input"][1] == first.output[0].model_dump(exclude_none=True) | body["input"][1]


def test_a_chain_of_five_turns_survives_a_restart(upstream: ScriptedUpstream, up: ScriptedUpstream,
                                                  tmp_path: Path) -> None:
    config = main_config(upstream.url, "auto")
    gateway = launch("chain", tmp_path, config).wait_ready()
    previous, words, sessions = None, [f"WORD-{i}-{uuid.uuid4().hex[:6]}" for i in range(5)], set()
    try:
        for i, word in enumerate(words):
            if i == 3:  # the process goes; its data dir stays
                stop_all([gateway])
                gateway = launch("chain", tmp_path, config).wait_ready()
            raw = client(gateway).responses.with_raw_response.create(
                model="gpt-4o", input=f"remember {word}", previous_response_id=previous,
                instructions="be brief" if i == 0 else None)  # not inherited: the session name must not follow it
            previous = raw.parse().id
            sessions.add(raw.headers["x-ctx-session"])
    finally:
        stop_all([gateway])
    last = sent(up)[-1]["input"]
    assert [i["content"] for i in last if i.get("role") == "user"] == [f"remember {w}" for w in words]
    assert [i["type"] for i in last if i.get("role") == "assistant"] == ["message"] * 4
    assert "instructions" not in sent(up)[-1] and len(sessions) == 1


def test_get_and_delete(gw: Gateway, up: ScriptedUpstream) -> None:
    cli = client(gw)
    r = cli.responses.create(model="gpt-4o", input="hi", extra_headers=session())
    got = cli.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == "ok"
    status, other = gw.get(f"/v1/responses/{r.id}", {"Authorization": f"Bearer {KEYS['relay']}"})
    assert status == 404 and other["error"]["code"] == "not_found"  # another tenant's response
    cli.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        cli.responses.retrieve(r.id)
    up.reset()
    with pytest.raises(openai.BadRequestError) as e:
        cli.responses.create(model="gpt-4o", input="again", previous_response_id=r.id)
    assert e.value.code == "previous_response_not_found" and not up.log


def test_a_store_false_response_is_not_kept(gw: Gateway, up: ScriptedUpstream) -> None:
    """As OpenAI: nothing to retrieve or chain. Such a client (Codex) resends its whole input
    each turn; keeping it would write the conversation again on every turn."""
    cli = client(gw)
    r = cli.responses.create(model="gpt-4o", input="hi", store=False, extra_headers=session())
    assert r.output_text == "ok"
    with pytest.raises(openai.NotFoundError):
        cli.responses.retrieve(r.id)
    up.reset()
    with pytest.raises(openai.BadRequestError) as e:
        cli.responses.create(model="gpt-4o", input="again", previous_response_id=r.id)
    assert e.value.code == "previous_response_not_found" and not up.log


def test_input_tokens_counts_what_would_be_forwarded(gw: Gateway, up: ScriptedUpstream) -> None:
    raw = client(gw).responses.input_tokens.with_raw_response.count(
        model="gpt-4o", input="hello there", instructions="be brief", extra_headers=session())
    assert raw.headers["x-ctx-count"] == "after-compaction"
    counted = raw.parse()
    assert counted.object == "response.input_tokens" and 5 < counted.input_tokens < 40
    assert not up.log


@pytest.mark.parametrize("body, param", [
    ({"model": "gpt-4o", "input": 12345}, "input"),
    ({"model": "gpt-4o", "input": [{"content": "no role"}]}, "input.0"),
    ({"model": "gpt-4o", "input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "hi"}, "model"),
])
def test_bad_input_is_a_400_with_no_upstream_call_and_no_session(gw: Gateway, up: ScriptedUpstream,
                                                                 body: dict[str, Any], param: str) -> None:
    headers = session()
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).post("/responses", body=body, cast_to=object, options={"headers": headers})
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param
    assert not up.log
    status, _ = gw.get(f"/v1/ctx/sessions/{headers['X-Ctx-Session']}", AUTH)
    assert status == 404


def test_unknown_previous_response_id(gw: Gateway, up: ScriptedUpstream) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).responses.create(model="gpt-4o", input="hi", previous_response_id="resp_nothing_here")
    assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
    assert not up.log


def test_litellm_bridge_for_a_provider_without_a_responses_api(gw: Gateway, up: ScriptedUpstream) -> None:
    cli = client(gw)
    r = cli.responses.create(model="deepseek-chat", input="hi", instructions="be brief", extra_headers=session())
    assert r.output_text == "ok"
    kinds = [e.type for e in cli.responses.create(model="deepseek-chat", input="hi", stream=True)]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert {e.door for e in up.log} == {"chat"}  # litellm spoke chat completions to it
    again = cli.responses.create(model="deepseek-chat", input="and now?", previous_response_id=r.id)
    assert again.output_text == "ok"
    assert "be brief" not in json.dumps(up.log[-1].body)  # instructions are not inherited, as on OpenAI


OBSERVATION = "PASSED tests/test_util.py::test_case line of output that repeats itself " * 25
TASK = "Task CODEX-TASK-9931: make the tests in src/lib/util.py pass."


REASONING_OF_LAST_STEP = {"type": "reasoning", "id": "rs_29", "summary": [],
                          "encrypted_content": "gAAAA-ENCRYPTED-29-" + "x" * 40}


def codex_items(steps: int) -> list[dict[str, Any]]:
    """A Codex-shaped session: shell calls and their outputs, encrypted reasoning last."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                    "content": [{"type": "input_text", "text": TASK}]}]
    for i in range(steps):
        if i == steps - 1:
            items.append({"type": "reasoning", "id": f"rs_{i}", "summary": [],
                          "encrypted_content": f"gAAAA-ENCRYPTED-{i}-" + "x" * 40})
        items.append({"type": "function_call", "id": f"fc_{i}", "call_id": f"call_{i}", "name": "shell",
                      "arguments": json.dumps({"cmd": ["bash", "-lc", f"pytest -x tests/test_util.py -k case_{i}"]})})
        items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": f"[{i}] " + OBSERVATION})
    return items


def test_a_long_codex_session_past_the_budget(gw: Gateway, up: ScriptedUpstream) -> None:
    budget, headers = 6000, {**session(), "X-Ctx-Budget": "6000"}
    cli, items, forwarded, levels = client(gw), codex_items(30), [], []
    for extra in range(4):
        up.reset()
        turn = items + codex_items(30 + extra)[len(items):]
        raw = cli.responses.with_raw_response.create(model="gpt-4o", input=turn, tools=TOOLS,  # type: ignore[arg-type]
                                                     include=["reasoning.encrypted_content"], store=False,
                                                     extra_headers=headers)
        assert raw.parse().output_text == "ok"
        levels.append(raw.headers["x-ctx-levels"])
        [entry] = [r for r in up.log if r.door == "responses"]
        assert entry.prompt_tokens is not None and entry.prompt_tokens <= budget
        body = entry.body["input"]
        calls = {i["call_id"] for i in body if i.get("type") == "function_call"}
        assert {i["call_id"] for i in body if i.get("type") == "function_call_output"} <= calls
        assert TASK in json.dumps(body)
        assert body[-1] == turn[-1]  # the last output verbatim
        for item in body:
            if item.get("type") == "reasoning":
                assert item == next(i for i in turn if i.get("id") == item["id"])  # byte-identical when kept
        forwarded.append(body)
        items = turn
    assert levels[0] != "none"
    assert REASONING_OF_LAST_STEP in forwarded[0]  # the newest steps reach the upstream verbatim
    steady = [n for n in range(1, 4) if levels[n] == "none"]
    assert steady, f"every turn compacted again: {levels}"
    n = steady[0]
    assert forwarded[n][:len(forwarded[n - 1]) - 1] == forwarded[n - 1][:-1]  # the prefix is stable
    status, summary = gw.get(f"/v1/ctx/sessions/{headers['X-Ctx-Session']}", AUTH)
    assert status == 200 and summary["wal_seq"] > 0 and summary["records"]


def test_litellm_forwarding_speaks_responses_natively_to_an_openai_route(
        main_gateways: dict[str, Gateway], up: ScriptedUpstream) -> None:
    cli = client(main_gateways["litellm"])
    r = cli.responses.create(model="gpt-4o", input="hi", extra_headers=session())
    assert r.output_text == "ok"
    kinds = [e.type for e in cli.responses.create(model="gpt-4o", input="hi", stream=True)]
    assert kinds[-1] == "response.completed"
    assert cli.responses.create(model="gpt-4o", input="more", previous_response_id=r.id).output_text == "ok"
    assert [e.door for e in up.log] == ["responses"] * 3
    assert "previous_response_id" not in up.log[-1].body and len(up.log[-1].body["input"]) == 3


def test_replicas_sharing_redis_resolve_each_others_chains(upstream: ScriptedUpstream, up: ScriptedUpstream,
                                                           redis_server: RedisServer, tmp_path: Path) -> None:
    config = main_config(upstream.url, "auto", state=redis_server.url)
    replicas = start_gateways({name: (tmp_path / name, config) for name in ("a", "b")})
    try:
        a, b = client(replicas["a"]), client(replicas["b"])
        first = a.responses.create(model="gpt-4o", input="remember REDIS-WORD-77")
        assert b.responses.create(model="gpt-4o", input="and?", previous_response_id=first.id).output_text == "ok"
        assert "REDIS-WORD-77" in json.dumps(up.log[-1].body["input"])
        assert b.responses.retrieve(first.id).id == first.id
        b.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(first.id)
    finally:
        stop_all(replicas.values())


def test_a_stream_that_stalls_ends_with_the_responses_error_event(upstream: ScriptedUpstream, up: ScriptedUpstream,
                                                                   tmp_path: Path) -> None:
    """Mid-stream the reply's headers are gone: the failure travels as the stream's own
    `error` event (the upstream sleeps 3 s between events; ctxgate waits 1.5 s)."""
    config = main_config(upstream.url, "auto", upstream_timeout_s=1.5)
    gateway = launch("stall", tmp_path, config).wait_ready()
    try:
        events = list(client(gateway).responses.create(model="slow", input="hi", stream=True))
        assert events[0].type == "response.created" and events[-1].type == "error"
        assert events[-1].code == "upstream_timeout" and "stalled" in events[-1].message  # type: ignore[union-attr]
        assert "response.completed" not in [e.type for e in events]
    finally:
        stop_all([gateway])


def test_a_reply_the_store_cannot_keep_still_reaches_the_client(gw: Gateway, up: ScriptedUpstream) -> None:
    """Keeping a response is the door's own bookkeeping: when it fails (here the tenant's
    folder of the store is a file), the reply the upstream was paid for is answered all the
    same, whole or streamed; a chain from it finds the store unavailable (503, retry later)."""
    assert gw.data_dir is not None
    folder = gw.data_dir / "responses" / "locked"
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.write_text("not a folder")
    cli = openai.OpenAI(base_url=gw.url, api_key=KEYS["locked"], max_retries=0)
    r = cli.responses.create(model="gpt-4o", input="hi", extra_headers=session())
    assert r.output_text == "ok"
    events = [e.type for e in cli.responses.create(model="gpt-4o", input="hi", stream=True, extra_headers=session())]
    assert events[-1] == "response.completed"
    up.reset()
    with pytest.raises(openai.InternalServerError) as e:
        cli.responses.create(model="gpt-4o", input="again", previous_response_id=r.id)
    assert e.value.status_code == 503 and e.value.code == "store_unavailable" and not up.log


def test_a_steady_session_sends_what_a_new_one_sends_and_checks_its_new_items(gw: Gateway,
                                                                              up: ScriptedUpstream) -> None:
    """Codex's way (`store: false`, the whole input every turn, a prompt_cache_key): a turn
    converts and checks only its new items, and forwards what a session seeing the whole
    conversation for the first time forwards; a bad new item is refused at its own index."""
    cli = client(gw)
    key = f"codex-{uuid.uuid4().hex[:8]}"
    items: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    for turn in range(3):
        cli.responses.create(model="gpt-4o", input=items, instructions="be brief", store=False,
                             prompt_cache_key=key)
        steady = sent(up)[-1]
        cli.responses.create(model="gpt-4o", input=items, instructions="be brief", store=False,
                             prompt_cache_key=f"{key}-fresh-{turn}")
        assert sent(up)[-1]["input"] == steady["input"] and steady["instructions"] == "be brief"
        items = [*items, {"type": "function_call", "call_id": f"c{turn}", "name": "shell", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": f"c{turn}", "output": "a.py"},
                 {"role": "user", "content": f"next {turn}"}]
    before = len(up.log)
    with pytest.raises(openai.BadRequestError) as e:
        cli.responses.create(model="gpt-4o", input=[*items, {"type": "function_call", "name": "shell"}],
                             instructions="be brief", store=False, prompt_cache_key=key)
    assert e.value.body["param"] == f"input.{len(items)}.call_id", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        cli.responses.create(model="gpt-4o", input=[{"role": "wizard", "content": "x"}, *items[1:]],
                             instructions="be brief", store=False, prompt_cache_key=key)
    assert e.value.body["param"] == "input.0", e.value.body
    assert len(up.log) == before
