"""Deleting a session's or a user's data through a running gateway: the session's WAL (live
log, archives, SQLite mirror rows), its state, its expansion originals, its stored Responses
and Idempotency-Key replies and the memory entries that name it go; another session's stay;
a user's every session goes, found by what the state and the WAL recorded (also after a
restart); another tenant cannot delete any of it; bad ids are 400s."""
from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ctxgate.memory.entries import Category
from ctxgate.wal.mirror import DB_NAME
from ctxgate.wal.paths import WalPaths
from clients import assert_error_shape, client, post
from servers import KEYS, Gateway, launch, main_config, start_gateways, wait_until
from test_expand_chat import TOOLS, build_log
from test_memory_provenance_api import captured, listed, seed
from upstream import ScriptedUpstream


def erase_config(upstream: ScriptedUpstream) -> dict[str, Any]:
    """Enterprise (the SQLite mirror), a checkpoint per write and an archive per checkpoint."""
    return main_config(upstream.url, "auto", profile="enterprise", wal={"checkpoint_every": 1, "archive_every": 1})


@pytest.fixture(scope="module")
def gw(upstream: ScriptedUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = start_gateways({"erase": (tmp_path_factory.mktemp("erase"), erase_config(upstream))})["erase"]
    yield gateway
    gateway.stop()


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def delete(gw: Gateway, path: str, key: str = KEYS["acme"]) -> httpx.Response:
    return httpx.delete(gw.base + path, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def paths(gw: Gateway) -> WalPaths:
    assert gw.data_dir is not None
    return WalPaths(gw.data_dir)


def originals(gw: Gateway, session: str) -> list[Path]:
    folder = paths(gw).data_dir / "content" / "acme" / session
    return list(folder.iterdir()) if folder.is_dir() else []


def mirror_rows(gw: Gateway, session: str) -> int:
    db = paths(gw).data_dir / DB_NAME
    if not db.exists():
        return 0
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM events WHERE session = ?", (session,)).fetchone()[0])


def work(gw: Gateway, session: str, user: str) -> dict[str, Any]:
    """A session that leaves data everywhere: a compacting turn (originals kept for expansion),
    a second turn (archives), a stored Responses reply, an Idempotency-Key reply and a
    captured memory entry naming it."""
    headers = {"X-Ctx-Session": session, "X-Ctx-User": user, "X-Ctx-Budget": "6000"}
    cli = client(gw)
    messages = build_log()
    reply = cli.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS, extra_headers=headers)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And now?"}]
    cli.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS, extra_headers=headers)
    stored = cli.responses.create(model="gpt-4o", input="hi", extra_headers={"X-Ctx-Session": session,
                                                                              "X-Ctx-User": user})
    key = uid("idem")
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": f"once {key}"}]}
    assert post(gw, body, headers={"Idempotency-Key": key, "X-Ctx-Session": session}).status_code == 200
    entry = captured(f"{session} builds with make.", user=user, session=session)
    seed(gw, entry)
    return {"response": stored.id, "idempotency": (key, body), "entry": entry.id}


def response_status(gw: Gateway, response_id: str) -> int:
    return httpx.get(f"{gw.base}/v1/responses/{response_id}", headers={"Authorization": f"Bearer {KEYS['acme']}"},
                     timeout=30).status_code


def session_status(gw: Gateway, session: str, key: str = KEYS["acme"]) -> int:
    return httpx.get(f"{gw.base}/v1/ctx/sessions/{session}", headers={"Authorization": f"Bearer {key}"},
                     timeout=30).status_code


def test_deleting_a_session_reaches_all_of_its_data_and_nothing_else(gw: Gateway, up: ScriptedUpstream) -> None:
    user = uid("u")
    gone, kept = uid("gone"), uid("kept")
    made = work(gw, gone, user)
    other = work(gw, kept, user)
    wal = paths(gw)
    assert wal.live("acme", gone).exists() and wal.archives("acme", gone) and originals(gw, gone)
    wait_until(lambda: mirror_rows(gw, gone) > 0 or None, 30, "the SQLite mirror to hold the session")

    deleted = delete(gw, f"/v1/ctx/sessions/{gone}")
    assert deleted.status_code == 200, deleted.text
    removed = deleted.json()["removed"]
    assert removed["sessions"] == removed["wal_logs"] == removed["responses"] == 1
    assert removed["idempotent_replies"] == 1 and removed["memory_entries"] == 1
    assert removed["wal_archives"] >= 1 and removed["expansion_originals"] >= 1 and removed["wal_mirror_rows"] >= 1

    assert not wal.live("acme", gone).exists() and wal.archives("acme", gone) == [] and originals(gw, gone) == []
    assert mirror_rows(gw, gone) == 0
    assert session_status(gw, gone) == 404
    assert response_status(gw, made["response"]) == 404
    assert listed(gw, f"session={gone}") == set()
    key, body = made["idempotency"]
    calls = len(up.chats())
    assert post(gw, body, headers={"Idempotency-Key": key}).status_code == 200
    assert len(up.chats()) == calls + 1  # no stored reply answered it: the upstream was asked again

    # the other session of the same user is whole
    assert wal.live("acme", kept).exists() and wal.archives("acme", kept) and originals(gw, kept)
    assert session_status(gw, kept) == 200 and response_status(gw, other["response"]) == 200
    assert listed(gw, f"session={kept}") == {other["entry"]}
    assert_error_shape(delete(gw, f"/v1/ctx/sessions/{gone}"), 404, "session_not_found")


def test_a_deleted_session_that_comes_back_starts_afresh(gw: Gateway, up: ScriptedUpstream) -> None:
    session = uid("again")
    work(gw, session, uid("u"))
    assert delete(gw, f"/v1/ctx/sessions/{session}").status_code == 200
    client(gw).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hello"}],
                                       extra_headers={"X-Ctx-Session": session})
    summary = httpx.get(f"{gw.base}/v1/ctx/sessions/{session}", headers={"Authorization": f"Bearer {KEYS['acme']}"},
                        timeout=30).json()
    assert summary["turns"] == 1 and summary["records"] == []


def test_another_tenant_cannot_delete_a_session_or_a_user(gw: Gateway) -> None:
    user, session = uid("u"), uid("mine")
    made = work(gw, session, user)
    for path in (f"/v1/ctx/sessions/{session}", f"/v1/ctx/users/{user}"):
        reply = delete(gw, path, key=KEYS["relay"])
        assert_error_shape(reply, 404)
    assert paths(gw).live("acme", session).exists() and originals(gw, session)
    assert session_status(gw, session) == 200 and response_status(gw, made["response"]) == 200
    assert listed(gw, f"session={session}") == {made["entry"]}


@pytest.mark.parametrize("bad", ["a..b", "a%20b", "-x", "x" * 129, "%C2%B2"])
def test_a_bad_id_is_a_400(gw: Gateway, bad: str) -> None:
    assert_error_shape(delete(gw, f"/v1/ctx/sessions/{bad}"), 400, "invalid_session")
    assert_error_shape(delete(gw, f"/v1/ctx/users/{bad}"), 400, "invalid_user")


def test_deleting_a_user_reaches_every_session_of_theirs_also_after_a_restart(
        upstream: ScriptedUpstream, tmp_path: Path) -> None:
    config = erase_config(upstream)
    gw = start_gateways({"erase-user": (tmp_path, config)})["erase-user"]
    user, other = uid("leaving"), uid("staying")
    theirs, others = [uid("s1"), uid("s2")], uid("s3")
    try:
        for session in theirs:
            work(gw, session, user)
        work(gw, others, other)
        own = httpx.post(gw.base + "/v1/ctx/memory", json={"category": "user", "content": "Prefers tabs.",
                                                            "scope": {"user": user}},
                         headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=30).json()
        assert own["scope"]["user"] == user and own["category"] == Category.USER.value
    finally:
        gw.stop()
    gw = launch("erase-user", tmp_path, config).wait_ready()  # in-process state gone: the WAL says whose
    try:
        deleted = delete(gw, f"/v1/ctx/users/{user}")
        assert deleted.status_code == 200, deleted.text
        reply = deleted.json()
        assert reply["sessions"] == sorted(theirs)
        assert reply["removed"]["wal_logs"] == 2 and reply["removed"]["memory_entries"] == 3
        for session in theirs:
            assert not paths(gw).live("acme", session).exists() and originals(gw, session) == []
        assert listed(gw, f"user={user}") == set()
        assert paths(gw).live("acme", others).exists() and originals(gw, others)
        assert len(listed(gw, f"user={other}")) == 1
        assert_error_shape(delete(gw, f"/v1/ctx/users/{user}"), 404, "user_not_found")
    finally:
        gw.stop()
