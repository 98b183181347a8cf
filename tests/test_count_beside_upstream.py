"""A new conversation far below the trigger is forwarded before its count is done and counted
beside the upstream call (`TurnEngine.prepare`, `ctxgate_counts_beside_upstream_total`); its
X-Ctx-Tokens-In/-Out, whole or streamed, and its WAL lines are what the same conversation gets
when it is counted first, on the chat door and the Responses door. One the bytes put near the
trigger is counted first, and compacted as before."""
from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from clients import KEYS, counted_beside
from ctxgate.pipeline.tokens import TokenizerRegistry
from ctxgate.proxy.doors.responses_model import to_messages
from ctxgate.wal.paths import WalPaths
from ctxgate.wal.reader import scan_file
from servers import Gateway
from upstream import ScriptedUpstream

COUNTER = TokenizerRegistry().for_model("gpt-4o")
"""The count the gateway must report: its own tokenizer's, run here on the same messages."""
LOGGED = ("USER_INPUT", "TOOL_RESULT")
PER_TURN = ("turn", "seq", "timestamp", "crc")
"""What differs between two sessions' logs of the same messages: the turn's number, the line's."""


def conversation(tag: str, steps: int = 14) -> list[dict[str, Any]]:
    """A new agent's conversation, every message its own: ~6 KB a step (14 steps: 84 KB)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": f"<{tag}> You are a coding agent."},
                                 {"role": "user", "content": f"<{tag}> Fix the failing test in calc.py."}]
    for i in range(steps):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read_file", "arguments": f'{{"path": "src/mod_{i}.py"}}'}}
        out += [{"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{i}",
                 "content": "".join(f"def f_{i}_{j}(x):\n    return x * {j}  # {tag} naïve 東京\n" for j in range(60))},
                {"role": "user", "content": f"<{tag}> Step {i} read; go on."}]
    return out


def send(gw: Gateway, messages: list[dict[str, Any]], session: str, stream: bool,
         headers: dict[str, str] | None = None, responses: bool = False) -> httpx.Headers:
    """The reply's headers, once the whole reply is read (a stream to its last event); with
    `responses`, the conversation sent to the Responses door as its items."""
    body: dict[str, Any] = {"model": "gpt-4o", "messages": messages, "stream": stream}
    if responses:
        body = {"model": "gpt-4o", "instructions": messages[0]["content"], "input": items(messages[1:]),
                "stream": stream, "store": False}
    sent = {"Authorization": f"Bearer {KEYS['acme']}", "X-Ctx-Session": session, **(headers or {})}
    path = "/responses" if responses else "/chat/completions"
    with httpx.stream("POST", gw.url + path, json=body, headers=sent, timeout=60) as r:
        text = r.read().decode()
        assert r.status_code == 200, text
    ended = ("response.completed" if responses else "data: [DONE]") if stream else '"output"' if responses \
        else '"choices"'
    assert ended in text
    return r.headers


def items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (user, assistant calls, tool results) as Responses input items."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant":
            out += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                     "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
        elif m["role"] == "tool":
            out.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def logged(gw: Gateway, session: str) -> list[dict[str, Any]]:
    assert gw.data_dir is not None
    return scan_file(WalPaths(gw.data_dir).live("acme", session)).events


def last_turn(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The last turn's message lines (less what names the turn and the line) and its RESPONSE."""
    turn = max(e["turn"] for e in events if e.get("type") in LOGGED)
    lines = [{k: v for k, v in e.items() if k not in PER_TURN} for e in events
             if e.get("type") in LOGGED and e["turn"] == turn]
    return lines, [e for e in events if e.get("type") == "RESPONSE"][-1]


@pytest.mark.parametrize("steps", [1, 8, 14], ids=["6KB", "48KB", "84KB"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_turn_counted_beside_the_upstream_call_reports_and_logs_the_exact_count(
        gateway: Gateway, up: ScriptedUpstream, stream: bool, steps: int) -> None:
    """Of any size: counted on the event loop up to the tokenizer's `inline_count_bytes`
    (64 KB), in a thread above."""
    messages = conversation(uuid.uuid4().hex, steps)
    late, first = f"late-{uuid.uuid4().hex}", f"first-{uuid.uuid4().hex}"
    before = counted_beside(gateway)
    got = send(gateway, messages, late, stream)
    assert counted_beside(gateway) == before + 1  # forwarded before its count was done
    exact = COUNTER.count_messages(messages)
    assert int(got["x-ctx-tokens-in"]) == exact
    assert int(got["x-ctx-tokens-out"]) == exact and got["x-ctx-levels"] == "none"

    # The same messages on a session with a turn behind it: counted before they are forwarded.
    send(gateway, conversation(uuid.uuid4().hex, steps=1), first, stream)
    counted = counted_beside(gateway)
    again = send(gateway, messages, first, stream)
    assert counted_beside(gateway) == counted
    assert (again["x-ctx-tokens-in"], again["x-ctx-tokens-out"]) == (got["x-ctx-tokens-in"], got["x-ctx-tokens-out"])

    lines, response = last_turn(logged(gateway, late))
    first_lines, first_response = last_turn(logged(gateway, first))
    assert len(lines) == sum(m["role"] in ("user", "tool") for m in messages)  # the client's own messages
    assert lines == first_lines
    assert (response["tokens_in"], response["tokens_out"]) == (first_response["tokens_in"],
                                                               first_response["tokens_out"]) == (exact, exact)
    # A turn's message lines carry its number, as its RESPONSE does, counted first or beside.
    for session in (late, first):
        events = logged(gateway, session)
        numbers = {e["turn"] for e in events if e.get("type") in LOGGED}
        assert {e["turn"] for e in events if e.get("type") == "RESPONSE"} == numbers


def test_a_new_conversation_near_the_trigger_is_counted_first_and_compacted(gateway: Gateway,
                                                                            up: ScriptedUpstream) -> None:
    messages = conversation(uuid.uuid4().hex)
    exact = COUNTER.count_messages(messages)
    before = counted_beside(gateway)
    got = send(gateway, messages, f"near-{uuid.uuid4().hex}", False, {"X-Ctx-Budget": str(exact)})
    assert counted_beside(gateway) == before
    assert int(got["x-ctx-tokens-in"]) == exact
    assert got["x-ctx-levels"] != "none" and int(got["x-ctx-tokens-out"]) < exact
    assert up.chats()[-1].body["messages"] != messages


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_responses_door_counts_a_new_conversation_beside_the_upstream_call(gateway: Gateway,
                                                                               up: ScriptedUpstream,
                                                                               stream: bool) -> None:
    messages = conversation(uuid.uuid4().hex)
    before = counted_beside(gateway)
    got = send(gateway, messages, f"late-{uuid.uuid4().hex}", stream, responses=True)
    assert counted_beside(gateway) == before + 1
    first = f"first-{uuid.uuid4().hex}"
    send(gateway, conversation(uuid.uuid4().hex, steps=1), first, stream, responses=True)
    counted = counted_beside(gateway)
    again = send(gateway, messages, first, stream, responses=True)
    assert counted_beside(gateway) == counted
    assert got["x-ctx-levels"] == again["x-ctx-levels"] == "none"
    assert (got["x-ctx-tokens-in"], got["x-ctx-tokens-out"]) == (again["x-ctx-tokens-in"], again["x-ctx-tokens-out"])
    converted = to_messages(messages[0]["content"], items(messages[1:]))
    assert int(got["x-ctx-tokens-in"]) == COUNTER.count_messages(converted)
