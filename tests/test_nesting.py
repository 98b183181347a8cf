"""One nesting limit, checked before anything happens: a body nested deeper than ctxgate
could re-encode is a 400 on every door, in the door's error shape, with no session, no log
line and nothing forwarded; one just under the limit goes through, also when it must be
re-encoded (a memory block or a compaction changes the body)."""
from __future__ import annotations

import json
import uuid
from typing import Any

import orjson
import pytest

from clients import KEYS, assert_error_shape, post
from ctxgate.proxy.doors.validation import MAX_NESTING
from servers import Gateway
from upstream import ScriptedUpstream


def _nested(levels: int) -> Any:
    """`levels` objects and arrays inside one another."""
    value: Any = 1
    for i in range(levels):
        value = {"a": value} if i % 2 else [value]
    return value


def _session() -> str:
    return f"nest-{uuid.uuid4().hex[:10]}"


def _chat(extra: dict[str, Any], messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": messages or [{"role": "user", "content": "hi"}], **extra}


# metadata sits at level 2 of the body; a message's own field at level 4.
@pytest.mark.parametrize("where", ["metadata", "message field", "tools"])
def test_a_body_nested_past_the_limit_is_refused_before_anything(gateway: Gateway, up: ScriptedUpstream,
                                                                  where: str) -> None:
    session = _session()
    deep = _nested(MAX_NESTING)
    body = {"metadata": _chat({"metadata": {"x": deep}}),
            "message field": _chat({}, [{"role": "user", "content": "hi", "extra": deep}]),
            "tools": _chat({"tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]})}[where]
    before = len(up.chats())
    err = assert_error_shape(post(gateway, body, headers={"X-Ctx-Session": session}), 400, "nesting_too_deep")
    assert str(MAX_NESTING) in err["message"]
    assert len(up.chats()) == before
    status, _ = gateway.get(f"/v1/ctx/sessions/{session}", {"Authorization": f"Bearer {KEYS['acme']}"})
    assert status == 404


def test_a_body_just_under_the_limit_is_forwarded_and_re_encoded(gateway: Gateway, up: ScriptedUpstream) -> None:
    # The body's own level and metadata's take two: this is MAX_NESTING levels in all.
    body = _chat({"metadata": {"x": _nested(MAX_NESTING - 2)}})
    assert post(gateway, body, headers={"X-Ctx-Session": _session()}).status_code == 200
    assert json.loads(up.chats()[-1].raw)["metadata"] == body["metadata"]


def test_what_the_limit_lets_in_can_be_re_encoded() -> None:
    """A forwarded body is re-encoded when ctxgate changed it (a compaction, the memory block,
    a deployment's parameters), with its nesting at most one level deeper (a compacted
    message wrapped in a list)."""
    body = _chat({"metadata": {"x": _nested(MAX_NESTING - 2)}})
    assert orjson.loads(orjson.dumps({"wrapped": [body]})) == {"wrapped": [body]}


def test_a_new_message_nested_past_the_limit_in_a_known_history(gateway: Gateway, up: ScriptedUpstream) -> None:
    session = _session()
    history = [{"role": "user", "content": "hi"}]
    assert post(gateway, _chat({}, history), headers={"X-Ctx-Session": session}).status_code == 200
    grown = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "text", "text": "x", "extra": _nested(MAX_NESTING)}]}]
    assert_error_shape(post(gateway, _chat({}, grown), headers={"X-Ctx-Session": session}), 400, "nesting_too_deep")


def test_the_other_doors_refuse_it_in_their_shape(gateway: Gateway, up: ScriptedUpstream) -> None:
    deep = _nested(MAX_NESTING)
    responses = post(gateway, {"model": "gpt-4o", "input": [{"role": "user", "content": "hi", "x": deep}]},
                     path="/v1/responses")
    assert_error_shape(responses, 400, "nesting_too_deep")
    messages = post(gateway, {"model": "gpt-4o", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi", "x": deep}]}]}, path="/v1/messages")
    assert messages.status_code == 400
    assert messages.json()["type"] == "error" and messages.json()["error"]["type"] == "invalid_request_error"
