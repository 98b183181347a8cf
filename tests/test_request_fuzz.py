"""Bad input changes nothing, found by a fuzzer: hypothesis generates request bodies around
each door's schema (valid shapes, wrong types, junk parts, deep and odd values, missing
fields) and posts them to a real gateway. Whatever a body is, the gateway answers it (never
a dropped connection), never with its own 500, always in the door's error shape; and a body
it refuses itself (nothing reached the upstream) leaves no session behind."""
from __future__ import annotations

import uuid
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from servers import KEYS, Gateway
from upstream import ScriptedUpstream

AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}
FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                    st.text(max_size=30))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
texts = st.one_of(st.text(max_size=40), json_values)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "wizard", "", "USER"])


def _maybe(d: dict[str, Any], draw: Any, key: str, values: st.SearchStrategy[Any]) -> None:
    if draw(st.booleans()):
        d[key] = draw(values)


@st.composite
def chat_parts(draw: Any) -> Any:
    return draw(st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
            st.fixed_dictionaries({"url": st.text(max_size=20)}), json_values)}),
        st.dictionaries(st.text(max_size=6), json_values, max_size=3), scalars))


@st.composite
def chat_messages(draw: Any) -> Any:
    m: dict[str, Any] = {}
    _maybe(m, draw, "role", st.one_of(roles, json_values))
    _maybe(m, draw, "content", st.one_of(st.text(max_size=60), st.none(), st.lists(chat_parts(), max_size=3),
                                         json_values))
    _maybe(m, draw, "tool_calls", st.one_of(st.lists(st.fixed_dictionaries({
        "id": texts, "type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": texts, "arguments": texts})}), max_size=2), json_values))
    _maybe(m, draw, "tool_call_id", texts)
    _maybe(m, draw, "name", texts)
    _maybe(m, draw, draw(st.text(min_size=1, max_size=6)), json_values)
    return m if draw(st.integers(0, 9)) else draw(scalars)


VALID_CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
              {"role": "user", "content": [{"type": "text", "text": "go on"}]}]


def chat_bodies() -> st.SearchStrategy[Any]:
    """A valid conversation with zero to two changes (a field's value, an extra field, a
    message added), or a body made from scratch around the schema."""
    return st.one_of(changed_chat_bodies(), scratch_chat_bodies())


@st.composite
def changed_chat_bodies(draw: Any) -> Any:
    messages = [dict(m) for m in VALID_CHAT]
    messages[1]["content"] = draw(st.text(min_size=1, max_size=40))  # valid bodies differ: each is tried
    messages[3]["content"] = draw(st.text(max_size=40))
    body: dict[str, Any] = {"model": "gpt-4o", "messages": messages}
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):  # a third or so stay valid, and are forwarded
        where = draw(st.integers(0, len(body["messages"])))
        if where == len(body["messages"]):
            body[draw(st.sampled_from(["stream", "n", "tools", "user", "metadata", "model", "x"]))] = draw(json_values)
        elif draw(st.booleans()):
            body["messages"][where][draw(st.sampled_from(["role", "content", "name", "tool_call_id", "x"]))] = draw(
                st.one_of(json_values, st.lists(chat_parts(), max_size=2)))
        else:
            body["messages"].insert(where, draw(chat_messages()))
    return body


@st.composite
def scratch_chat_bodies(draw: Any) -> Any:
    body: dict[str, Any] = {}
    _maybe(body, draw, "model", st.one_of(st.just("gpt-4o"), st.just("gpt-4o"), texts))
    _maybe(body, draw, "messages", st.one_of(st.lists(chat_messages(), max_size=5),
                                             st.lists(chat_messages(), max_size=5), json_values))
    for key, values in (("stream", st.one_of(st.booleans(), scalars)), ("n", scalars), ("tools", json_values),
                        ("user", texts), ("metadata", json_values), ("stream_options", json_values),
                        ("prompt_cache_key", texts)):
        if draw(st.integers(0, 4)) == 0:
            body[key] = draw(values)
    return body


@st.composite
def messages_bodies(draw: Any) -> Any:
    block = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                      st.fixed_dictionaries({"type": st.just("tool_use"), "id": texts, "name": texts,
                                             "input": json_values}),
                      st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": texts,
                                             "content": texts}), json_values)
    message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant"]), roles),
                                     "content": st.one_of(st.text(max_size=40), st.lists(block, max_size=3),
                                                          json_values)})
    valid = draw(st.booleans())
    body: dict[str, Any] = {"model": "gpt-4o" if valid else draw(st.one_of(st.just("gpt-4o"), texts)),
                            "max_tokens": 64 if valid else draw(st.one_of(st.just(64), scalars)),
                            "messages": [{"role": "user", "content": "hi"}, *draw(st.lists(message, max_size=2))]
                            if valid else draw(st.one_of(st.lists(message, max_size=4), json_values))}
    for key, values in (("system", st.one_of(texts, st.lists(block, max_size=2))), ("tools", json_values),
                        ("stream", st.one_of(st.booleans(), scalars)), ("metadata", json_values)):
        if draw(st.integers(0, 3)) == 0:
            body[key] = draw(values)
    if draw(st.integers(0, 9)) == 0:
        del body[draw(st.sampled_from(sorted(body)))]
    return body


@st.composite
def responses_bodies(draw: Any) -> Any:
    item = st.one_of(
        st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system"]), roles),
                               "content": st.one_of(st.text(max_size=40), json_values)}),
        st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "message",
                                                        "reasoning", "x"]),
                               "call_id": texts, "name": texts, "arguments": texts, "output": texts}),
        json_values)
    valid = draw(st.booleans())
    body: dict[str, Any] = {"model": "gpt-4o" if valid else draw(st.one_of(st.just("gpt-4o"), texts)),
                            "input": [{"role": "user", "content": "hi"}] + draw(st.lists(item, max_size=2)) if valid
                            else draw(st.one_of(st.text(max_size=40), st.lists(item, max_size=4), json_values))}
    for key, values in (("instructions", texts), ("previous_response_id", texts), ("tools", json_values),
                        ("stream", st.one_of(st.booleans(), scalars)), ("store", scalars)):
        if draw(st.integers(0, 3)) == 0:
            body[key] = draw(values)
    return body


def _post(gw: Gateway, path: str, body: Any, session: str) -> httpx.Response:
    headers = {**AUTH, "Content-Type": "application/json", "X-Ctx-Session": session, "x-api-key": KEYS["acme"],
               "anthropic-version": "2023-06-01"}
    return httpx.post(gw.base + path, content=orjson.dumps(body), headers=headers, timeout=30)


def _check(gw: Gateway, up: ScriptedUpstream, path: str, body: Any) -> None:
    session = f"fuzz-{uuid.uuid4().hex[:12]}"
    before = len(up.log)
    resp = _post(gw, path, body, session)
    reached = len(up.log) > before
    event(f"{resp.status_code} {'forwarded' if reached else 'not forwarded'}")
    assert resp.status_code < 500 or reached, (resp.status_code, resp.text[:300], body)
    if resp.status_code >= 400:
        error = resp.json()
        if path == "/v1/messages":
            assert error["type"] == "error" and isinstance(error["error"]["message"], str), error
        else:
            assert isinstance(error["error"]["message"], str), error
            assert error["error"].get("code") != "internal_error", (error, body)
        if not reached:  # refused by ctxgate itself: nothing of it may remain
            status, _ = gw.get(f"/v1/ctx/sessions/{session}", AUTH)
            assert status == 404, (resp.status_code, resp.text[:300], body)


@pytest.mark.parametrize("path, bodies", [("/v1/chat/completions", chat_bodies()),
                                          ("/v1/messages", messages_bodies()),
                                          ("/v1/responses", responses_bodies())])
def test_any_body_is_answered_and_a_refused_one_changes_nothing(gateway: Gateway, up: ScriptedUpstream, path: str,
                                                                 bodies: st.SearchStrategy[Any]) -> None:
    @FUZZ
    @given(body=bodies)
    def run(body: Any) -> None:
        _check(gateway, up, path, body)

    run()
