"""The WAL through a running gateway: what each turn logs, restart and rollback,
Idempotency-Key replies, a log that cannot be written, profiles and tenants."""
from __future__ import annotations

import asyncio
import json
from collections import Counter
import signal
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from ctxgate.proxy.engine.idempotency import _InFlight
from ctxgate.proxy.doors.chat_replies import SseReply
from ctxgate.wal.paths import WalPaths
from ctxgate.wal.reader import scan_file
from clients import (MESSAGES, TOOLS, agent_turns, assert_error_shape, client, counted_beside, feasible_turns,
                     post)
from servers import KEYS, Gateway, launch, main_config, run_ctxgate, start_gateways, wait_until
from trajectories import openhands
from upstream import ScriptedUpstream, prompt_tokens


@pytest.fixture(scope="module")
def walgw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("walgw")
    gw = start_gateways({"wal": (base, main_config(upstream.url, "auto"))})["wal"]
    yield gw
    gw.stop()


def _session() -> str:
    return "w-" + uuid.uuid4().hex[:12]


def _events(gw: Gateway, session: str, tenant: str = "acme", archived: bool = False) -> list[dict[str, Any]]:
    """The session's live log; `archived`: its archived segments first (every 10 checkpoints,
    the live log's older events move there)."""
    assert gw.data_dir is not None
    paths = WalPaths(gw.data_dir)
    events = []
    for path in [*(paths.archives(tenant, session) if archived else []), paths.live(tenant, session)]:
        scan = scan_file(path)
        assert scan.ok, (scan.damaged, scan.torn)
        events += scan.events
    return events


def test_a_turn_logs_its_input_the_reply_and_its_tool_calls(walgw: Gateway, up: ScriptedUpstream) -> None:
    session = _session()
    cli = client(walgw)
    reply = cli.chat.completions.create(model="gpt-4o-tools", messages=MESSAGES, tools=TOOLS,
                                        extra_headers={"X-Ctx-Session": session})
    call = reply.choices[0].message.tool_calls[0]
    follow = [*MESSAGES, reply.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "Traceback (most recent call last):\nValueError: x"}]
    cli.chat.completions.create(model="gpt-4o", messages=follow, extra_headers={"X-Ctx-Session": session})

    events = _events(walgw, session)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert [e["type"] for e in events] == ["USER_INPUT", "USER_INPUT", "RESPONSE", "TOOL_CALL", "TOOL_RESULT",
                                           "RESPONSE"]
    first = events[0]
    assert first["index"] == 1 and len(first["content_hash"]) == 32 and "content" not in first  # hashed by default
    assert events[3]["tool"] == "read_file" and events[3]["call_id"] == call.id and events[3]["params_hash"]
    result = events[4]
    assert result["tool"] == "read_file" and result["index"] == 5 and result["success"] is False
    assert result["error"] == "ValueError: x" and result["result_tokens"] > 5  # what activeRestore would name
    assert events[2]["status"] == 200 and events[2]["tool_calls"] == 1
    assert events[2]["prompt_tokens"] == up.chats()[0].prompt_tokens


def test_a_periodic_checkpoint_follows_the_reply_that_made_it_due(walgw: Gateway, up: ScriptedUpstream) -> None:
    """101 user messages in one request pass `checkpoint_every` (100): their lines are written
    before it is forwarded, the periodic CHECKPOINT after its RESPONSE (no reply waits for its
    fsync), and it holds the answered turn."""
    session = _session()
    messages = [m for i in range(101) for m in ({"role": "user", "content": f"step {i}"},
                                                 {"role": "assistant", "content": "ok"})][:-1]
    client(walgw).chat.completions.create(model="gpt-4o", messages=messages, extra_headers={"X-Ctx-Session": session})
    events = wait_until(lambda: (found := _events(walgw, session)) and found[-1]["type"] == "CHECKPOINT" and found,
                        what="the periodic checkpoint")
    assert [e["type"] for e in events] == ["USER_INPUT"] * 101 + ["RESPONSE", "CHECKPOINT"]
    assert events[-1]["reason"] == "periodic" and events[-1]["state"]["answered_turns"] == 1


def test_the_minimal_profile_keeps_no_log(walgw: Gateway) -> None:
    session = _session()
    client(walgw).chat.completions.create(model="gpt-4o", messages=MESSAGES, extra_headers={
        "X-Ctx-Session": session, "X-Ctx-Profile": "minimal"})
    assert walgw.data_dir is not None
    assert not WalPaths(walgw.data_dir).live("acme", session).exists()


def _compacting_run(gw: Gateway, session: str, turns: list[list[dict[str, Any]]], budget: int,
                    tools: Any) -> list[str]:
    cli = client(gw)
    levels = []
    for messages in turns:
        raw = cli.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=messages, tools=tools,
            extra_headers={"X-Ctx-Session": session, "X-Ctx-Budget": str(budget)})
        levels.append(raw.headers["x-ctx-levels"])
    return levels


@pytest.fixture(scope="module")
def trajectory() -> Any:
    return max(openhands(), key=lambda t: len(t.messages))


def test_rollback_to_a_checkpoint_forwards_what_the_session_forwarded_then(
        walgw: Gateway, up: ScriptedUpstream, trajectory: Any) -> None:
    session = _session()
    budget = int(prompt_tokens(trajectory.messages) * 0.25)
    turns = feasible_turns(agent_turns(trajectory.messages), budget)
    levels = _compacting_run(walgw, session, turns, budget, trajectory.tools)
    forwarded = [c.body["messages"] for c in up.chats() if c.body.get("model") == "gpt-4o"]
    assert len(forwarded) == len(turns)
    compactions = [e for e in _events(walgw, session, archived=True)
                   if e["type"] == "CHECKPOINT" and e["reason"] == "compaction"]
    assert len(compactions) >= 2, levels
    first = compactions[0]
    at = first["state"]["turns"] - 1  # the turn (0-based) whose compaction it recorded
    assert levels[at] != "none" and levels[at + 1] == "none"

    status, listed = walgw.get(f"/v1/ctx/sessions/{session}/checkpoints", {"Authorization": f"Bearer {KEYS['acme']}"})
    assert status == 200 and first["seq"] in [c["seq"] for c in listed["data"]]
    assert all("state" not in c for c in listed["data"])
    done = post(walgw, {"to_seq": first["seq"]}, path=f"/v1/ctx/sessions/{session}/rollback")
    assert done.status_code == 200, done.text
    assert done.json()["rolled_back_to"] == first["seq"]

    up.reset()
    client(walgw).chat.completions.create(model="gpt-4o", messages=turns[at + 1], tools=trajectory.tools,
                                          extra_headers={"X-Ctx-Session": session, "X-Ctx-Budget": str(budget)})
    again = [c for c in up.chats() if c.body.get("model") == "gpt-4o"]
    assert len(again) == 1 and again[0].body["messages"] == forwarded[at + 1]


def test_rollback_refuses_bad_input_and_other_tenants(walgw: Gateway) -> None:
    session = _session()
    client(walgw).chat.completions.create(model="gpt-4o", messages=MESSAGES, extra_headers={"X-Ctx-Session": session})
    path = f"/v1/ctx/sessions/{session}/rollback"
    for body in ({}, {"to_seq": "3"}, {"to_seq": 0}, {"to_seq": True}, [1]):
        assert_error_shape(post(walgw, body, path=path), 400, "invalid_request")
    assert_error_shape(post(walgw, raw=b"{not json", path=path), 400, "invalid_request")
    err = assert_error_shape(post(walgw, {"to_seq": 999}, path=path), 404, "checkpoint_not_found")
    assert "no checkpoint at seq 999" in err["message"]
    assert_error_shape(post(walgw, {"to_seq": 1}, path=path, key=KEYS["relay"]), 404, "checkpoint_not_found")
    assert_error_shape(post(walgw, {"to_seq": 1}, path="/v1/ctx/sessions/..%2Fx/rollback"), (400, 404))


def test_an_idempotent_retry_is_answered_from_the_stored_reply(walgw: Gateway, up: ScriptedUpstream) -> None:
    key, body = "idem-" + uuid.uuid4().hex, {"model": "gpt-4o", "messages": MESSAGES}
    first = post(walgw, body, headers={"Idempotency-Key": key, "X-Ctx-Session": _session()})
    again = post(walgw, body, headers={"Idempotency-Key": key, "X-Ctx-Session": _session()})
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert len(up.chats()) == 1

    other = post(walgw, {**body, "temperature": 0.5}, headers={"Idempotency-Key": key})
    assert_error_shape(other, 422, "idempotency_key_reused")
    assert_error_shape(post(walgw, body, headers={"Idempotency-Key": "k" * 256}), 400, "invalid_idempotency_key")
    assert len(up.chats()) == 1
    fresh = post(walgw, body, headers={"Idempotency-Key": key}, key=KEYS["relay"])  # keys are per tenant
    assert fresh.status_code == 200 and "idempotent-replayed" not in fresh.headers and len(up.chats()) == 2


def test_an_idempotent_stream_is_replayed_to_the_sdk(walgw: Gateway, up: ScriptedUpstream) -> None:
    key = "idem-" + uuid.uuid4().hex
    cli = client(walgw)
    texts = []
    for _ in range(2):
        stream = cli.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True,
                                             extra_headers={"Idempotency-Key": key})
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert texts[0] == texts[1] == "ok"
    assert len(up.chats()) == 1


def test_a_log_that_cannot_be_written_refuses_the_turn_and_forwards_nothing(walgw: Gateway,
                                                                            up: ScriptedUpstream) -> None:
    """A new conversation far below the trigger is forwarded before it is logged
    (`count_beside.py`): the first whose log fails is answered, the failure logged. Until an
    append of the tenant succeeds, its turns are logged first and refused with nothing
    forwarded: that session's next turn, and new conversations too."""
    assert walgw.data_dir is not None
    blocker = walgw.data_dir / "wal" / "locked"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the tenant's folder should be")
    session = {"X-Ctx-Session": f"locked-{uuid.uuid4().hex}"}
    following = [*MESSAGES, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Go on."}]
    other = [{"role": "user", "content": f"Another task {uuid.uuid4().hex}."}]
    try:
        first = post(walgw, {"model": "gpt-4o", "messages": MESSAGES}, key=KEYS["locked"], headers=session)
        assert first.status_code == 200, first.text
        assert len(up.chats()) == 1
        for messages, headers in [(following, session), (other, {"X-Ctx-Session": f"new-{uuid.uuid4().hex}"})]:
            resp = post(walgw, {"model": "gpt-4o", "messages": messages}, key=KEYS["locked"], headers=headers)
            assert_error_shape(resp, 503, "wal_unavailable")
            assert "nothing was forwarded" in resp.json()["error"]["message"]
        assert len(up.chats()) == 1
    finally:
        blocker.unlink()
    assert post(walgw, {"model": "gpt-4o", "messages": following}, key=KEYS["locked"],
                headers=session).status_code == 200
    assert len(up.chats()) == 2
    before = counted_beside(walgw)
    assert post(walgw, {"model": "gpt-4o", "messages": other}, key=KEYS["locked"],
                headers={"X-Ctx-Session": f"new-{uuid.uuid4().hex}"}).status_code == 200
    assert counted_beside(walgw) == before + 1  # the log is written again: new conversations go beside again


def _restart(gw: Gateway, sig: int) -> Gateway:
    gw.proc.send_signal(sig)
    gw.proc.wait(30)
    assert gw.data_dir is not None and gw.config is not None
    return launch(gw.name, gw.data_dir.parent, gw.config).wait_ready()


def test_after_kill_9_the_session_and_the_idempotent_replies_carry_on(tmp_path: Path, trajectory: Any) -> None:
    """The restarted gateway forwards, byte for byte, what a gateway that never crashed does,
    and asks for no summary the control did not ask for. Each has its own upstream."""
    ups = {name: ScriptedUpstream().start() for name in ("crash", "control")}
    gws = start_gateways({name: (tmp_path / name, main_config(up.url, "auto")) for name, up in ups.items()})
    crash, control = gws["crash"], gws["control"]
    try:
        budget = int(prompt_tokens(trajectory.messages) * 0.3)
        turns = feasible_turns(agent_turns(trajectory.messages), budget)[:24]
        control_levels = _compacting_run(control, "s", turns, budget, trajectory.tools)
        _compacting_run(crash, "s", turns[:-1], budget, trajectory.tools)
        key = "idem-" + uuid.uuid4().hex
        before = post(crash, {"model": "gpt-4o", "messages": MESSAGES}, headers={"Idempotency-Key": key})
        assert before.status_code == 200
        crash = _restart(crash, signal.SIGKILL)
        wait_until(lambda: "sessions from the WAL at start (of 2 logs)" in crash.text(), 20,
                   "the sessions rebuilt at start")
        assert _compacting_run(crash, "s", turns[-1:], budget, trajectory.tools) == control_levels[-1:]

        def chats(name: str, model: str) -> list[Any]:
            return [c for c in ups[name].chats() if c.body.get("model") == model]

        assert chats("crash", "gpt-4o")[-1].body["messages"] == chats("control", "gpt-4o")[-1].body["messages"]
        wait_until(lambda: len(chats("crash", "summarizer")) == len(chats("control", "summarizer")), 10,
                   "the same number of summaries with and without the crash")
        assert (Counter(c.raw for c in chats("crash", "summarizer"))
                == Counter(c.raw for c in chats("control", "summarizer")))

        calls = len(ups["crash"].chats())
        after = post(crash, {"model": "gpt-4o", "messages": MESSAGES}, headers={"Idempotency-Key": key})
        assert after.content == before.content and after.headers["idempotent-replayed"] == "true"
        assert len(ups["crash"].chats()) == calls
        auth = {"Authorization": f"Bearer {KEYS['acme']}"}
        (status, summary), (_, reference) = (crash.get("/v1/ctx/sessions/s", auth),
                                             control.get("/v1/ctx/sessions/s", auth))
        assert status == 200, summary
        assert summary["turns"] == reference["turns"] and summary["records"] == reference["records"]
        # The upstream leaves the tools schema out of its count: the measured offset came back too.
        assert summary["count_offset"] == reference["count_offset"] < 0
        assert summary["wal_seq"] > 0
    finally:
        crash.stop()
        control.stop()
        for up in ups.values():
            up.stop()


def test_enterprise_mirrors_into_sqlite_and_ctxgate_stats_reads_it(upstream: ScriptedUpstream, tmp_path: Path,
                                                                   trajectory: Any) -> None:
    config = main_config(upstream.url, "auto", profile="enterprise", wal={"store_content": True})
    gw = start_gateways({"ent": (tmp_path, config)})["ent"]
    try:
        budget = int(prompt_tokens(trajectory.messages) * 0.3)
        _compacting_run(gw, "ent-1", feasible_turns(agent_turns(trajectory.messages), budget)[:16], budget,
                        trajectory.tools)
        events = _events(gw, "ent-1")
        assert events[0]["type"] == "USER_INPUT" and isinstance(events[0]["content"], str)  # store_content
        compressions = [e for e in events if e["type"] == "COMPRESSION"]
        assert compressions
    finally:
        gw.stop()  # closing the gateway drains the mirror's queue
    done = run_ctxgate(["stats", "--json", "--data-dir", str(gw.data_dir)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert sum(r["compressions"] for r in rows) == len(compressions)
    assert {r["tenant"] for r in rows} == {"acme"}


# -- units of the reply bookkeeping ---------------------------------------------------------

def test_a_tool_call_event_split_across_network_chunks_is_still_logged() -> None:
    event = (b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_9","type":"function",'
             b'"function":{"name":"read_file","arguments":"{}"}}]}}]}\n\n')
    whole, split = SseReply(), SseReply()
    whole.feed(event + b"data: [DONE]\n\n")
    for piece in (event[:40], event[40:90], event[90:], b"data: [DONE]\n\n"):
        split.feed(piece)
    assert split.facts().tool_calls == whole.facts().tool_calls
    assert [c["id"] for c in split.facts().tool_calls] == ["call_9"]


async def test_one_request_per_idempotency_key_at_a_time() -> None:
    in_flight, inside, most = _InFlight(), 0, 0

    async def request(delay: float) -> None:
        nonlocal inside, most
        await asyncio.sleep(delay)
        async with in_flight.hold("t", "k"):
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.02)
            inside -= 1

    await asyncio.gather(*(request(i * 0.01) for i in range(4)))
    assert most == 1
