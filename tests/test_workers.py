"""`ctxgate serve --workers N`: N real worker processes on one port, sharing session state
through a real Redis; refused with per-process (memory) state."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from clients import MESSAGES, post
from servers import (LIVE, METRICS_HEADERS, Gateway, RedisServer, child_env, ctxgate_command, free_port, main_config,
                     stop_all, wait_until)
from upstream import ScriptedUpstream

WORKERS = 3


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid`, from /proc (zombies do not count)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def port_free(port: int) -> bool:
    """Nothing listens there: a connection is refused, and a server could bind it again
    (with SO_REUSEADDR, as servers do: the test's closed connections linger in TIME_WAIT)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        pass
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def served(gw: Gateway) -> int:
    """The chat requests the worker that answers counted, from its /metrics."""
    status, text = gw.get("/metrics", METRICS_HEADERS)
    assert status == 200
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in str(text).splitlines()
               if line.startswith("ctxgate_requests_total{") and 'model="gpt-4o"' in line)


def serve_workers(workdir: Path, config: dict, workers: str) -> Gateway:  # type: ignore[type-arg]
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "ctxgate.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    output = workdir / "ctxgate.log"
    with output.open("wb") as out:
        proc = subprocess.Popen([*ctxgate_command(), "serve", "--host", "127.0.0.1", "--port", str(port),
                                 "--data-dir", str(workdir / "data"), "--config", str(path), "--workers", workers],
                                stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=child_env())
    gw = Gateway(f"workers-{workers}", port, proc, output, config, workdir / "data")
    LIVE.append(gw)
    return gw


@pytest.fixture(scope="module")
def pool(upstream: ScriptedUpstream, redis_server: RedisServer,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = serve_workers(tmp_path_factory.mktemp("workers"), main_config(upstream.url, "auto", state=redis_server.url),
                       str(WORKERS))
    try:
        gw.wait_ready()
        wait_until(lambda: "with 3 workers" in gw.text(), 60, "the parent's listening line")
    except BaseException:
        stop_all([gw])
        raise
    yield gw
    stop_all([gw])


def test_several_workers_with_memory_state_are_refused(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    path = tmp_path / "ctxgate.yaml"
    path.write_text(yaml.safe_dump(main_config(upstream.url, "auto")))
    done = subprocess.run([*ctxgate_command(), "serve", "--config", str(path), "--port", str(free_port()),
                           "--data-dir", str(tmp_path / "data"), "--workers", "2"], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--workers 2 needs a shared state backend: set ctxgate.state to a Redis URL (redis:// or redis+cluster://)" \
        in done.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was opened


def test_requests_spread_over_workers_share_sessions(pool: Gateway, up: ScriptedUpstream) -> None:
    line = next(ln for ln in pool.text().splitlines() if "with 3 workers" in ln)
    assert line.startswith(f"ctxgate listening on http://127.0.0.1:{pool.port}/v1 with 3 workers (")
    workers = children_of(pool.proc.pid)
    assert len(workers) == WORKERS

    def one(i: int) -> int:
        return post(pool, {"model": "gpt-4o", "messages": MESSAGES},
                    headers={"X-Ctx-Session": f"spread-{i}"}).status_code

    with ThreadPoolExecutor(30) as ex:
        assert list(ex.map(one, range(30))) == [200] * 30
    assert sorted(children_of(pool.proc.pid)) == sorted(workers)  # all still serving, none restarted
    # each worker counts its own requests: a /metrics answer (each on a new connection, so the
    # kernel picks a worker) that counts some of the 30 but not all shows they were spread
    seen = {served(pool) for _ in range(40)}
    assert any(0 < n < 30 for n in seen), seen

    # one session, ten turns, each on a new connection (the kernel picks the worker each time)
    history = list(MESSAGES)
    for turn in range(10):
        resp = post(pool, {"model": "gpt-4o", "messages": history}, headers={"X-Ctx-Session": "across"})
        assert resp.status_code == 200, resp.text
        history += [resp.json()["choices"][0]["message"], {"role": "user", "content": f"and then {turn}?"}]
    status, state = pool.get("/v1/ctx/sessions/across", {"Authorization": "Bearer sk-acme"})
    assert status == 200 and state["turns"] == 10, state


def test_sigterm_to_the_parent_stops_every_worker(pool: Gateway) -> None:
    workers = children_of(pool.proc.pid)
    assert len(workers) == WORKERS
    pool.proc.send_signal(signal.SIGTERM)
    assert pool.proc.wait(20) == 0
    wait_until(lambda: not any(alive(pid) for pid in workers), 10, "the workers to exit")
    assert wait_until(lambda: port_free(pool.port), 5, "the port to be free")


def test_a_worker_that_dies_stops_the_others(redis_server: RedisServer, tmp_path: Path) -> None:
    # no model_list: the offline demo model, which starts without importing litellm
    gw = serve_workers(tmp_path, {"ctxgate": {"state": redis_server.url}}, "2")
    try:
        gw.wait_ready()
        wait_until(lambda: "with 2 workers" in gw.text(), 60, "the parent's listening line")
        first, second = children_of(gw.proc.pid)
        os.kill(first, signal.SIGKILL)
        assert gw.proc.wait(20) == 1
        assert "stopping the others" in gw.text()
        wait_until(lambda: not alive(second), 10, "the other worker to exit")
    finally:
        stop_all([gw])


def test_two_writers_of_one_session_log_archive_at_a_line_boundary(tmp_path: Path) -> None:
    """Workers on one data dir write one session's log in turn (the Redis session lock makes
    their appends follow each other); archiving must still cut before a CHECKPOINT line."""
    from ctxgate.wal.paths import WalPaths
    from ctxgate.wal.writer import WalWriter

    paths = WalPaths(tmp_path)
    first, second = WalWriter(paths, archive_every=1), WalWriter(paths, archive_every=1)
    done = first.append("t", "s", [{"type": "TURN"}, {"type": "CHECKPOINT"}])
    done = second.append("t", "s", [{"type": "TURN", "pad": "y" * 40}], after_seq=done.last_seq)
    done = first.append("t", "s", [{"type": "TURN"}, {"type": "CHECKPOINT"}], after_seq=done.last_seq)
    assert done.archived is not None
    assert paths.live("t", "s").read_bytes().startswith(b'{"seq":5,"type":"CHECKPOINT"')  # cut before it
    assert done.archived.read_bytes().endswith(b"\n")
