"""Memory through a running gateway: the API, injection (what the upstream receives),
stability across turns, the budget cap, tenant isolation, auto-dream at session end
through the scripted summarizer (and its timeout path), and persistence across a restart."""
from __future__ import annotations

import asyncio
import json
import signal
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ctxgate.memory.redis_short_term import RedisShortTermStore
from ctxgate.wal.paths import WalPaths
from ctxgate.wal.reader import scan_file
from ctxgate.pipeline.notes import NOTICE
from clients import assert_error_shape, client, post
from servers import KEYS, Gateway, launch, main_config, start_gateways, wait_until
from upstream import ScriptedUpstream, encode

SYSTEM = {"role": "system", "content": "You are a coding agent."}


@pytest.fixture(scope="module")
def memgw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = main_config(upstream.url, "auto", memory={"dream_model": "summarizer", "end_timeout_s": 2})
    gw = start_gateways({"mem": (tmp_path_factory.mktemp("memgw"), config)})["mem"]
    yield gw
    gw.stop()


def _api(gw: Gateway, method: str, path: str, body: Any = None, key: str = KEYS["acme"]) -> httpx.Response:
    return httpx.request(method, gw.base + "/v1/ctx/memory" + path, json=body, timeout=30,
                         headers={"Authorization": f"Bearer {key}"})


MEMORY_OPEN = '<ctxgate-context source="memory">\n'


def _memory_message(up: ScriptedUpstream) -> dict[str, Any] | None:
    messages = [c for c in up.chats() if c.body.get("model") == "gpt-4o"][-1].body["messages"]
    # Quoted data in a user-role message, never a system one (entries are not instructions).
    assert not any(m["role"] == "system" and "Long-term memory" in str(m["content"]) for m in messages)
    found = [m for m in messages if m["role"] == "user" and m["content"].startswith(MEMORY_OPEN + "Long-term memory")]
    assert len(found) <= 1
    if found:  # right after the client's own system prompt and ctxgate's notice saying what it is
        assert messages.index(found[0]) == 2 and messages[1] == {"role": "system", "content": NOTICE}
    return found[0] if found else None


def _chat(gw: Gateway, content: str, session: str, key: str = KEYS["acme"], **headers: str) -> None:
    client(gw, key).chat.completions.create(model="gpt-4o", messages=[SYSTEM, {"role": "user", "content": content}],
                                            user="u1", extra_headers={"X-Ctx-Session": session, **headers})


def test_crud_for_the_callers_tenant_only(memgw: Gateway) -> None:
    made = _api(memgw, "POST", "", {"category": "user", "content": "Likes short answers.", "scope": {"user": "u9"}})
    assert made.status_code == 201, made.text
    entry = made.json()
    assert entry["id"].startswith("mem_") and entry["scope"] == {"user": "u9", "project": None}
    assert "tenant" not in entry
    listed = _api(memgw, "GET", "?category=user&user=u9").json()["data"]
    assert [e["id"] for e in listed] == [entry["id"]]
    changed = _api(memgw, "PATCH", f"/{entry['id']}", {"content": "Likes very short answers."})
    assert changed.status_code == 200 and changed.json()["content"] == "Likes very short answers."

    other = KEYS["relay"]
    assert entry["id"] not in json.dumps(_api(memgw, "GET", "", key=other).json())
    assert_error_shape(_api(memgw, "PATCH", f"/{entry['id']}", {"content": "x"}, key=other), 404, "memory_not_found")
    assert_error_shape(_api(memgw, "DELETE", f"/{entry['id']}", key=other), 404, "memory_not_found")
    assert _api(memgw, "GET", "?category=user&user=u9").json()["data"][0]["content"] == "Likes very short answers."

    assert _api(memgw, "DELETE", f"/{entry['id']}").json() == {"id": entry["id"], "object": "memory.entry.deleted",
                                                                "deleted": True}
    assert_error_shape(_api(memgw, "DELETE", f"/{entry['id']}"), 404, "memory_not_found")


@pytest.mark.parametrize("body", [{}, {"category": "dreams", "content": "x"}, {"category": "user", "content": ""},
                                  {"category": "user", "content": "x", "tenant": "relay"},
                                  {"category": "user", "content": "x", "scope": {"user": 5}},
                                  {"category": "feedback", "content": "x", "ttl_s": -1}, [1, 2]])
def test_bad_entries_are_refused_and_change_nothing(memgw: Gateway, body: Any) -> None:
    before = _api(memgw, "GET", "").json()["data"]
    assert_error_shape(_api(memgw, "POST", "", body), 400)
    assert_error_shape(post(memgw, raw=b"{nope", path="/v1/ctx/memory"), 400, "invalid_json")
    assert_error_shape(_api(memgw, "GET", "?category=dreams"), 400)
    assert _api(memgw, "GET", "").json()["data"] == before


def test_memory_is_injected_once_stays_byte_identical_and_changes_only_with_memory(
        memgw: Gateway, up: ScriptedUpstream) -> None:
    session = "m-" + uuid.uuid4().hex[:8]
    _api(memgw, "POST", "", {"category": "user", "content": "Answer in Esperanto."})
    first = _api(memgw, "POST", "", {"category": "feedback", "content": "Use rg, not grep.",
                                     "data": {"correction_type": "tool_choice"}}).json()
    assert first["expires_at"] - first["created_at"] == pytest.approx(7 * 86400, abs=5)
    blocks = []
    for text in ("Which language?", "And now?", "Still?"):
        _chat(memgw, text, session)
        block = _memory_message(up)
        assert block is not None
        blocks.append(block["content"])
    assert blocks[0] == blocks[1] == blocks[2]
    assert "Answer in Esperanto." in blocks[0] and "Use rg, not grep." in blocks[0]
    _api(memgw, "POST", "", {"category": "user", "content": "Signs off as Zamenhof."})
    _chat(memgw, "Once more?", session)
    same = _memory_message(up)
    assert same is not None and same["content"] == blocks[0]  # the turn does not wait for the rebuild

    def rebuilt() -> str | None:
        _chat(memgw, "Once more?", session)
        block = _memory_message(up)
        return block["content"] if block and "Zamenhof" in block["content"] else None

    block = wait_until(rebuilt, 10, "the rebuilt block")
    assert "Answer in Esperanto." in block and "Use rg, not grep." in block  # the rest is kept

    _chat(memgw, "Which language?", session, key=KEYS["relay"])
    assert _memory_message(up) is None  # another tenant: nothing of acme's
    _chat(memgw, "Which language?", "m-min-" + session, **{"X-Ctx-Profile": "minimal"})
    assert _memory_message(up) is None  # the minimal profile keeps no memory


def test_the_block_stays_within_its_share_of_the_budget(memgw: Gateway, up: ScriptedUpstream) -> None:
    for i in range(60):  # about 18,000 tokens in all: three times the block's share
        _api(memgw, "POST", "", {"category": "user", "content": f"Preference number {i}: " + "detail " * 300,
                                 "scope": {"user": "budget-user"}}, key=KEYS["locked"])
    client(memgw, KEYS["locked"]).chat.completions.create(
        model="gpt-4o", messages=[SYSTEM, {"role": "user", "content": "hi"}], user="budget-user")
    block = _memory_message(up)
    assert block is not None
    assert len(encode(block["content"])) <= 0.05 * 128_000 * 0.95 and "Preference number" in block["content"]
    assert block["content"].count("Preference number") < 60  # the cap left some out


def _wal_events(gw: Gateway, session: str) -> list[dict[str, Any]]:
    assert gw.data_dir is not None
    return scan_file(WalPaths(gw.data_dir).live("acme", session)).events


def test_session_end_consolidates_what_the_session_taught(memgw: Gateway, up: ScriptedUpstream) -> None:
    session = "m-end-" + uuid.uuid4().hex[:8]
    _chat(memgw, "I prefer tabs over spaces. Please always write docstrings.", session)
    ended = post(memgw, {}, path=f"/v1/ctx/sessions/{session}/end")
    assert ended.status_code == 200, ended.text
    event = ended.json()["auto_dream"]
    assert event["entries_count"] == 2 and event["consolidated"] is True and event["trigger"] == "B"
    summaries = [c for c in up.chats() if c.body.get("model") == "summarizer"]
    assert summaries and "Extract the new preferences" in summaries[-1].body["messages"][0]["content"]
    dreams = [e for e in _wal_events(memgw, session) if e["type"] == "AUTO_DREAM"]
    assert len(dreams) == 1 and dreams[0]["categories"] == ["user"]
    users = _api(memgw, "GET", "?category=user&user=u1").json()["data"]
    assert any(e["data"].get("consolidated_from") == 2 for e in users)


def test_ending_a_session_that_does_not_exist_is_404(memgw: Gateway, up: ScriptedUpstream) -> None:
    ended = post(memgw, {}, path=f"/v1/ctx/sessions/never-{uuid.uuid4().hex[:8]}/end")
    assert ended.status_code == 404 and ended.json()["error"]["code"] == "session_not_found"


def test_a_slow_dream_model_at_session_end_quarantines_the_raw_entries(upstream: ScriptedUpstream,
                                                                       tmp_path: Path) -> None:
    """Pitfall 4: nothing is lost and nothing blocks; but what no model vetted is never injected."""
    config = main_config(upstream.url, "auto", memory={"dream_model": "slow", "end_timeout_s": 0.5})
    gw = start_gateways({"slowdream": (tmp_path, config)})["slowdream"]
    try:
        _chat(gw, "From now on reply in French.", "s1")
        event = post(gw, {}, path="/v1/ctx/sessions/s1/end").json()["auto_dream"]
        assert event["consolidated"] is False and event["written"] == 1
        saved = _api(gw, "GET", "?category=user").json()["data"]
        assert [e["content"] for e in saved] == ["From now on reply in French."]
        assert saved[0]["quarantine"]["attempts"] == 1 and "timed out" in saved[0]["quarantine"]["reason"]
        assert saved[0]["provenance"][0]["source"] == "human" and saved[0]["provenance"][0]["session"] == "s1"
        _chat(gw, "What language?", "s2")
        forwarded = [c for c in upstream.chats() if c.body.get("model") == "gpt-4o"][-1].body["messages"]
        assert "French" not in str(forwarded)
    finally:
        gw.stop()


def test_memory_outlives_a_restart(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    config = main_config(upstream.url, "auto", memory={"dream_model": "summarizer"})
    gw = start_gateways({"persist": (tmp_path, config)})["persist"]
    made = _api(gw, "POST", "", {"category": "reference", "content": "Checkout API takes a cart id."}).json()
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(30)
    gw = launch("persist", tmp_path, config).wait_ready()
    try:
        assert [e["id"] for e in _api(gw, "GET", "?category=reference").json()["data"]] == [made["id"]]
        upstream.reset()
        _chat(gw, "How does the checkout API work?", "p1")
        block = _memory_message(upstream)
        assert block is not None and "Checkout API takes a cart id." in block["content"]
    finally:
        gw.stop()


def test_what_a_replica_killed_with_9_captured_is_consolidated_by_another(
        upstream: ScriptedUpstream, tmp_path: Path, redis_server: Any) -> None:
    """With the state in Redis, the short-term buffer is there too: replica a captures, dies
    with SIGKILL before the session ends, and replica b ends it with a's candidates."""
    config = main_config(upstream.url, "auto", state=redis_server.url,
                         memory={"dream_model": "summarizer", "end_timeout_s": 5})
    gws = start_gateways({"mem-a": (tmp_path / "a", config), "mem-b": (tmp_path / "b", config)})
    a, b = gws["mem-a"], gws["mem-b"]
    session = "m-kill-" + uuid.uuid4().hex[:8]

    def buffered() -> tuple[Any, list[Any]]:
        async def peek() -> tuple[Any, list[Any]]:
            observer = RedisShortTermStore(redis_server.url)
            try:
                return await observer.peek(("acme", session))
            finally:
                await observer.close()
        return asyncio.run(peek())

    try:
        _chat(a, "I prefer tabs over spaces. Please always write docstrings.", session)
        wait_until(lambda: len(buffered()[1]) == 2, 30, "replica a to buffer what the turn taught")
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(30)
        ended = post(b, {}, path=f"/v1/ctx/sessions/{session}/end")
        assert ended.status_code == 200, ended.text
        event = ended.json()["auto_dream"]
        assert event["entries_count"] == 2 and event["trigger"] == "B"
        assert event["consolidated"] is True and buffered() == (None, [])
    finally:
        for gw in (a, b):
            gw.stop()


def test_an_unreachable_memory_store_is_a_503_not_a_500(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    config = main_config(upstream.url, "auto", state="redis://127.0.0.1:1/0")
    gw = start_gateways({"deadmem": (tmp_path, config)})["deadmem"]
    try:
        assert_error_shape(_api(gw, "GET", ""), 503)
        assert_error_shape(_api(gw, "POST", "", {"category": "user", "content": "x"}), 503)
    finally:
        gw.stop()
