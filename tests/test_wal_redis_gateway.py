"""The WAL on Redis through running gateways and the CLI: a turn's log is a stream and no
file is written, `ctxgate wal` reads and rolls it back, a log Redis that goes away or a
WAIT that is not met refuses the turn with 503 before anything is forwarded (but a new
conversation's, logged beside its upstream call: answered, and the turns after it refused)."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
import yaml

from clients import MESSAGES, assert_error_shape, post
from servers import Gateway, RedisServer, model_list, run_ctxgate, start_gateways, stop_all, wait_until
from upstream import ScriptedUpstream

BODY = {"model": "gpt-4o", "messages": MESSAGES}


@pytest.fixture(scope="module")
def log_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis holding only a WAL, which a test stops."""
    server = RedisServer.start(tmp_path_factory.mktemp("log-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateways(upstream: ScriptedUpstream, redis_server: RedisServer, log_redis: RedisServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Gateway]]:
    base = tmp_path_factory.mktemp("walredis")
    state = redis_server.url
    configs: dict[str, dict[str, Any]] = {
        "shared": {"state": state, "wal": {"checkpoint_every": 3}},  # the log beside the state, by default
        "apart": {"state": state, "wal": {"redis_url": log_redis.url}},
        "waits": {"state": state, "wal": {"redis_wait_replicas": 1, "redis_wait_timeout_ms": 100}},
    }
    specs = {name: (base / name, {"model_list": model_list(upstream.url), "ctxgate": ctxgate})
             for name, ctxgate in configs.items()}
    found = start_gateways(specs)
    yield found
    stop_all(found.values())


def _session() -> str:
    return "wr-" + uuid.uuid4().hex[:12]


def _stream(url: str, session: str) -> list[dict[str, Any]]:
    conn = redis.Redis.from_url(url)
    try:
        entries = conn.xrange(f"ctxgate:wal:default:{session}")
    finally:
        conn.close()
    return [json.loads(fields[b"line"]) for _, fields in entries]


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_a_turn_is_logged_to_a_stream_and_no_wal_file_is_written(gateways: dict[str, Gateway], up: ScriptedUpstream,
                                                                 redis_server: RedisServer) -> None:
    gw = gateways["shared"]
    session = _session()
    for _ in range(2):
        assert post(gw, BODY, headers={"X-Ctx-Session": session}, key=None).status_code == 200
    events = _stream(redis_server.url, session)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert [e["type"] for e in events].count("RESPONSE") == 2 and events[0]["type"] == "USER_INPUT"
    assert gw.data_dir is not None
    assert _files(gw.data_dir / "wal") == [] and _files(gw.data_dir / "wal_archive") == []


def _cli(tmp_path: Path, config: dict[str, Any], *args: str) -> tuple[int, str]:
    path = tmp_path / "ctxgate.yaml"
    path.write_text(yaml.safe_dump(config))
    done = run_ctxgate([*args, "--config", str(path), "--data-dir", str(tmp_path / "data")], cwd=tmp_path)
    return done.returncode, done.stdout if "--json" in args else done.stdout + done.stderr


def test_the_cli_reads_replays_rolls_back_and_archives_the_redis_log(gateways: dict[str, Gateway], up: ScriptedUpstream,
                                                                     redis_server: RedisServer,
                                                                     tmp_path: Path) -> None:
    gw = gateways["shared"]
    session = _session()
    headers = {"X-Ctx-Session": session}
    for _ in range(2):
        assert post(gw, BODY, headers=headers, key=None).status_code == 200
    config = {"ctxgate": {"state": redis_server.url, "wal": {"checkpoint_every": 3}}}
    code, out = _cli(tmp_path, config, "wal", "list", "--json")
    rows = {r["session"]: r for r in json.loads(out)}
    assert code == 0 and rows[session]["events"] == len(_stream(redis_server.url, session))
    code, out = _cli(tmp_path, config, "wal", "show", session)
    assert code == 0 and "RESPONSE" in out and f"of default/{session}" in out
    code, out = _cli(tmp_path, config, "wal", "replay", session, "--json")
    assert code == 0 and json.loads(out)["turns"] == 2
    code, out = _cli(tmp_path, config, "wal", "verify", session)
    assert code == 0 and "0 damaged lines" in out

    def checkpoints() -> list[int]:  # wal.checkpoint_every: 3, written after the reply
        status, listed = gw.get(f"/v1/ctx/sessions/{session}/checkpoints")
        assert status == 200
        return [c["seq"] for c in listed["data"]]
    seqs = wait_until(checkpoints, what="a periodic checkpoint")
    code, out = _cli(tmp_path, config, "wal", "rollback", session, "--to", str(seqs[0]))
    assert code == 0 and f"rolled back to checkpoint {seqs[0]}" in out
    assert _stream(redis_server.url, session)[-1]["rolled_back_to"] == seqs[0]
    code, out = _cli(tmp_path, config, "wal", "archive", "--tenant", "default", "--json")
    assert code == 0 and any(a["session"] == session for a in json.loads(out)["archived"])
    code, out = _cli(tmp_path, config, "wal", "show", session, "--limit", "0", "--json")
    shown = [e["seq"] for e in json.loads(out)]
    assert code == 0 and shown == list(range(1, len(shown) + 1))  # the archive's events, then the stream's
    code, out = _cli(tmp_path, config, "wal", "replay", session, "--json")
    assert code == 0 and json.loads(out)["turns"] == 1  # the rolled-back state, read after the archive pass
    code, out = _cli(tmp_path, {"ctxgate": {"state": "memory"}}, "wal", "show", session)
    assert code == 2 and "no log of session" in out  # the file backend: nothing was written there


def test_a_log_redis_that_goes_away_refuses_the_turn_and_forwards_nothing(gateways: dict[str, Gateway],
                                                                          up: ScriptedUpstream,
                                                                          log_redis: RedisServer) -> None:
    gw = gateways["apart"]
    session = _session()
    assert post(gw, BODY, headers={"X-Ctx-Session": session}, key=None).status_code == 200
    assert [e["type"] for e in _stream(log_redis.url, session)][-1] == "RESPONSE"
    assert gw.get("/readyz") == (200, {"status": "ready"})
    log_redis.stop()
    assert gw.get("/readyz") == (503, {"status": "session log unreachable"})  # its state store is still up
    up.reset()
    resp = post(gw, {**BODY, "messages": [*MESSAGES, {"role": "user", "content": "and then?"}]},
                headers={"X-Ctx-Session": session}, key=None)
    err = assert_error_shape(resp, 503, "wal_unavailable")
    assert "nothing was forwarded" in err["message"]
    assert up.chats() == []


def test_wait_for_a_replica_a_lone_redis_does_not_have_refuses_the_turn(gateways: dict[str, Gateway],
                                                                        up: ScriptedUpstream) -> None:
    """A session's first turn far below the trigger is forwarded before it is logged
    (`count_beside.py`): answered, the log's failure logged; its next turn is logged first,
    and refused with nothing forwarded."""
    session = {"X-Ctx-Session": _session()}
    assert post(gateways["waits"], BODY, headers=session, key=None).status_code == 200
    up.reset()
    resp = post(gateways["waits"], {**BODY, "messages": [*MESSAGES, {"role": "assistant", "content": "ok"},
                                                         {"role": "user", "content": "and then?"}]},
                headers=session, key=None)
    err = assert_error_shape(resp, 503, "wal_unavailable")
    assert "0 of 1 Redis replicas" in err["message"]
    assert up.chats() == []
