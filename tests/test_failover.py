"""Failover: two `ctxgate serve` replicas share one Redis (AOF on) and nothing else, each
with a data directory of its own. The official SDK sends each turn of a long compacting
session to a replica it picks at random; one replica is killed with SIGKILL in the middle
of a streamed turn, or while its Autocompact call is in flight, and the other carries the
session on. Redis itself is also killed and restarted under a running session.

What passes: the upstream receives, turn for turn, the bytes one replica alone sent for
the same turns (the reference run, on its own tenant so that nothing of it is shared);
every acknowledged turn is in the session log once, in order, as the reference has it; no
summary is asked for again once its compaction point is logged; an Idempotency-Key retry
sent to the surviving replica is answered from the stored reply.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import random
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest

from ctxgate.proxy.engine.redis_state import RedisSessionStore
from ctxgate.redis_backend import RedisTarget
from ctxgate.wal.config import WalConfig
from clients import agent_turns, assert_error_shape, feasible_turns
from servers import (Gateway, RedisServer, launch, main_config, model_list, run_ctxgate, start_gateways, stop_all,
                     wait_until)
from redis_cluster import RedisClusterNodes
from trajectories import openhands
from upstream import ScriptedUpstream, prompt_tokens

REDIS_WAL = "backend" in WalConfig.model_fields
"""The session log can live in Redis: without it each replica logs to its own disk, and no
replica could carry on another's log."""
needs_redis_wal = pytest.mark.skipif(not REDIS_WAL, reason="needs wal.backend: redis")

MODEL = "slow"
"""Every turn's model: answered at once while the upstream's `slow_s` is 0, held open
(between stream events, or before a whole reply) while it is not."""
SLOW_SUMMARIZER = "slow-summarizer"
"""A summarizer that waits `slow_s` before its summary: its call can be caught in flight."""
HELD_S = 120.0
"""How long the upstream holds a call meant to be cut by a kill (it never gets that far)."""
SDK_HTTP = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])
"""The HTTP library under the SDK (httpx, httpx2 in later releases): a stream cut short raises its errors."""
CUT = (openai.APIError, SDK_HTTP.HTTPError)
KEYS = {"pair": "sk-pair", "alone": "sk-alone"}
"""The replicas' tenant and the reference run's: nothing of one (memory, idempotency keys) reaches the other."""


@dataclass
class Agent:
    """The client: one turn after another through the official SDK, each to a replica it is told."""
    tenant: str
    session: str
    budget: int
    tools: Any
    acknowledged: int = 0
    """Turns whose reply came back whole."""

    def headers(self, idempotency_key: str | None = None) -> dict[str, str]:
        return {"X-Ctx-Session": self.session, "X-Ctx-Budget": str(self.budget),
                **({"Idempotency-Key": idempotency_key} if idempotency_key else {})}

    def sdk(self, gw: Gateway, timeout: float = 60.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=gw.url, api_key=KEYS[self.tenant], max_retries=0, timeout=timeout)

    def stream(self, gw: Gateway, messages: list[dict[str, Any]], idempotency_key: str | None = None
               ) -> Iterator[str]:
        """The turn streamed: yields each text delta; the turn is acknowledged at the stream's end."""
        chunks = self.sdk(gw).chat.completions.create(model=MODEL, messages=messages, tools=self.tools, stream=True,
                                                      extra_headers=self.headers(idempotency_key))
        for chunk in chunks:
            yield "".join(c.delta.content or "" for c in chunk.choices)
        self.acknowledged += 1

    def replayed(self, gw: Gateway, messages: list[dict[str, Any]], idempotency_key: str) -> tuple[Any, str]:
        """A streamed turn sent again with its key: the reply's headers and text (not a new turn)."""
        raw = self.sdk(gw).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, tools=self.tools, stream=True, extra_headers=self.headers(idempotency_key))
        text = "".join(c.delta.content or "" for chunk in raw.parse() for c in chunk.choices)
        return raw.headers, text

    def whole(self, gw: Gateway, messages: list[dict[str, Any]], idempotency_key: str | None = None,
              timeout: float = 60.0) -> Any:
        """The turn, whole: the SDK's HTTP response (its headers, its bytes)."""
        raw = self.sdk(gw, timeout).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, tools=self.tools, extra_headers=self.headers(idempotency_key))
        self.acknowledged += 1
        return raw.http_response


@dataclass
class Cluster:
    """The replicas on one Redis and one upstream (the reference run goes through replica a alone)."""
    upstream: ScriptedUpstream
    redis: RedisServer | RedisClusterNodes
    replicas: dict[str, Gateway]
    workdir: Path
    log_dir: Path
    """The `--data-dir` of `ctxgate wal show`: with several replicas, one no replica ever wrote
    to (their log is in Redis or nowhere); with one, its own (its log is there or in Redis)."""
    killed: list[Any] = field(default_factory=list)
    """Upstream calls in flight when their replica was killed: they were never answered."""

    def kill(self, name: str) -> None:
        gw = self.replicas[name]
        gw.proc.kill()
        gw.proc.wait(10)
        stop_all([gw])

    def relaunch(self, name: str) -> Gateway:
        old = self.replicas[name]
        assert old.data_dir is not None
        self.replicas[name] = launch(name, old.data_dir.parent, old.config)
        return self.replicas[name]

    def stop(self) -> None:
        stop_all(self.replicas.values())
        self.redis.stop()
        self.upstream.stop()

    def calls_in_flight(self, model: str) -> list[Any]:
        return [c for c in self.upstream.chats()
                if isinstance(c.body, dict) and c.body.get("model") == model and not c.done]

    def calls(self, model: str) -> list[Any]:
        return [c for c in self.upstream.chats() if c.body.get("model") == model and c not in self.killed]

    def background_done(self, agent: Agent) -> bool:
        """No upstream call open and no background compaction in flight for the session."""
        if not all(c.done for c in self.upstream.log):
            return False
        target = RedisTarget.parse(self.redis.url)
        conn = target.sync_client()
        try:
            raw = conn.get(f"ctxgate:session:{target.tag(agent.tenant, agent.session)}{agent.tenant}:{agent.session}")
        finally:
            conn.close()
        return raw is None or not json.loads(raw).get("speculation")

    def between_turns(self, agent: Agent) -> None:
        """The agent runs its tools between turns: a background compaction started by the last
        turn ends first, wherever it runs, so each run is the same however busy the machine."""
        wait_until(lambda: self.background_done(agent), 60, "the background compaction to end")

    def wal(self, agent: Agent) -> list[dict[str, Any]]:
        """The session's log as `ctxgate wal show` reads it with the replicas' config."""
        config = self.workdir / "a" / "ctxgate.yaml"
        done = run_ctxgate(["wal", "show", agent.session, "--tenant", agent.tenant, "--json", "--limit", "0",
                            "--config", str(config), "--data-dir", str(self.log_dir)], cwd=self.workdir)
        assert done.returncode == 0, done.stderr
        events: list[dict[str, Any]] = json.loads(done.stdout)
        return events


def _config(upstream: ScriptedUpstream, redis_url: str, summarizer: str, speculation: bool) -> dict[str, Any]:
    autocompact: dict[str, Any] = {"model": summarizer} | ({} if speculation else {"speculative_ratio": None})
    # Without Snip, which would free these spans alone: the summaries are what a failover must not pay twice.
    config = main_config(upstream.url, "auto", state=redis_url,
                         pipeline={"autocompact": autocompact, "levels": ["microcompact", "collapse", "autocompact"]},
                         tenants={t: {"api_keys": [k], "allow_overrides": ["budget"]} for t, k in KEYS.items()},
                         **({"wal": {"backend": "redis"}} if REDIS_WAL else {}))
    config["model_list"] = [*model_list(upstream.url), {
        "model_name": SLOW_SUMMARIZER, "litellm_params": {"model": f"openai/{SLOW_SUMMARIZER}",
                                                          "api_base": f"{upstream.url}/v1", "api_key": "sk-up"},
        "model_info": {"max_input_tokens": 128_000}}]
    return config


@pytest.fixture
def cluster_of(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def start(summarizer: str = "summarizer", speculation: bool = True, replicas: tuple[str, ...] = ("a", "b")
              ) -> Cluster:
        up = ScriptedUpstream(slow_s=0.0).start()
        server = RedisServer.start(tmp_path / "redis", aof=True)
        config = _config(up, server.url, summarizer, speculation)
        gws = start_gateways({name: (tmp_path / name, config) for name in replicas})
        log_dir = tmp_path / "no-disk" if len(gws) > 1 else tmp_path / replicas[0] / "data"
        made.append(Cluster(up, server, gws, tmp_path, log_dir))
        return made[-1]

    yield start
    for cluster in made:
        cluster.stop()


@pytest.fixture(scope="module")
def trajectory() -> Any:
    return max(openhands(), key=lambda t: len(t.messages))


def _agent(tenant: str, trajectory: Any) -> Agent:
    budget = int(prompt_tokens(trajectory.messages) * 0.3)
    return Agent(tenant, f"{tenant}-{uuid.uuid4().hex[:8]}", budget, trajectory.tools)


def _turns(agent: Agent, trajectory: Any, count: int | None = None) -> list[list[dict[str, Any]]]:
    return feasible_turns(agent_turns(trajectory.messages), agent.budget)[:count]


def _record(cluster: Cluster, summarizer: str) -> tuple[list[bytes], Counter[bytes]]:
    """What the upstream received: every turn's bytes in order, and each summary request."""
    return [c.raw for c in cluster.calls(MODEL)], Counter(c.raw for c in cluster.calls(summarizer))


def _logged(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a session log says, in a form two runs can be compared by."""
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs)), "seqs are unique and in order"
    answered = [e["turn"] for e in events if e["type"] == "RESPONSE"]
    assert answered == sorted(set(answered)), "each answered turn once, in order"
    return {"inputs": [(e["type"], e["index"], e.get("content_hash"), e.get("call_id")) for e in events
                       if e["type"] in ("USER_INPUT", "TOOL_RESULT")],
            "responses": len(answered),
            "compactions": sum(1 for e in events if e["type"] == "CHECKPOINT" and e["reason"] == "compaction")}


def _assert_same_as_alone(cluster: Cluster, agent: Agent, reference: dict[str, Any], summarizer: str) -> None:
    turns, summaries = _record(cluster, summarizer)
    assert len(turns) == len(reference["turns"])
    for i, (sent, alone) in enumerate(zip(turns, reference["turns"])):
        assert sent == alone, f"turn {i}: the forwarded bytes differ from one replica alone's"
    assert summaries == reference["summaries"], "a summary asked for twice, or one missing"
    logged = _logged(cluster.wal(agent))
    assert logged == reference["log"]
    assert logged["responses"] == agent.acknowledged
    if len(cluster.replicas) > 1:  # the log the survivor carried on is in Redis, on no replica's disk
        assert not [f for gw in cluster.replicas.values() if gw.data_dir for f in gw.data_dir.rglob("wal_*")]


def _reference(cluster: Cluster, trajectory: Any, summarizer: str, run: Callable[[Agent], None]) -> dict[str, Any]:
    """The same turns through one replica alone, then the upstream's log is cleared."""
    agent = _agent("alone", trajectory)
    run(agent)
    cluster.between_turns(agent)
    turns, summaries = _record(cluster, summarizer)
    found = {"turns": turns, "summaries": summaries, "log": _logged(cluster.wal(agent))}
    assert found["log"]["compactions"] >= 2 and found["log"]["responses"] == agent.acknowledged
    cluster.upstream.reset()
    return found


@needs_redis_wal
def test_a_replica_killed_mid_stream_the_other_carries_the_session_on(cluster_of: Callable[..., Cluster],
                                                                      trajectory: Any) -> None:
    cluster = cluster_of()
    turns = _turns(_agent("pair", trajectory), trajectory)
    keys = [f"idem-{i}-{uuid.uuid4().hex}" for i in range(len(turns))]  # every turn may be retried
    summaries_before: list[int] = []

    def alone(agent: Agent) -> None:
        for i, messages in enumerate(turns):
            cluster.between_turns(agent)
            summaries_before.append(len(cluster.calls("summarizer")))
            assert "".join(agent.stream(cluster.replicas["a"], messages, keys[i])) == "ok"
        cluster.between_turns(agent)
        summaries_before.append(len(cluster.calls("summarizer")))
    reference = _reference(cluster, trajectory, "summarizer", alone)
    # Killed in a turn that asks for no summary: a summary the dead replica was paid for and
    # never logged (a background compaction cut short) would rightly be asked for again.
    quiet = [i for i in range(len(turns)) if summaries_before[i] > 0 and summaries_before[i + 1] == summaries_before[i]]
    assert quiet, f"no turn without a summary after the first one: {summaries_before}"
    kill_at = quiet[len(quiet) // 2]

    rng = random.Random(16)
    agent = _agent("pair", trajectory)
    for i, messages in enumerate(turns):
        cluster.between_turns(agent)
        if i != kill_at:
            # The turn before the kill is the dying replica's, so its retry below crosses over.
            gw = cluster.replicas["a" if i == kill_at - 1 else rng.choice(sorted(cluster.replicas))]
            assert "".join(agent.stream(gw, messages, keys[i])) == "ok"
            continue
        cluster.upstream.slow_s = HELD_S
        with ThreadPoolExecutor(1) as pool:
            attempt = pool.submit(lambda: list(agent.stream(cluster.replicas["a"], messages, keys[i])))
            # The upstream's stream is under way (its first event sent, the next held back): the
            # client may have it or not yet (a compacted session's reply is held until it shows
            # what it opens with), either way the turn is mid-stream.
            cluster.killed += wait_until(lambda: [c for c in cluster.upstream.chats() if c.body.get("model") == MODEL
                                                  and c.body.get("stream") and c.response and not c.done], 30,
                                         "the turn's stream to be under way")
            cluster.kill("a")
            cluster.upstream.slow_s = 0.0
            with pytest.raises(CUT):
                attempt.result(30)
        survivor, calls = cluster.replicas["b"], len(cluster.upstream.chats())
        headers, text = agent.replayed(survivor, turns[i - 1], keys[i - 1])
        assert headers.get("idempotent-replayed") == "true" and text == "ok"
        assert len(cluster.upstream.chats()) == calls  # answered from the stored reply
        # The cut turn again, with its key: the dead replica's hold on the key lapses first.
        assert "".join(agent.stream(survivor, messages, keys[i])) == "ok"
        cluster.relaunch("a").wait_ready()  # back with nothing of its own: it rejoins the random picks
    cluster.between_turns(agent)
    assert len(cluster.killed) == 1 and cluster.killed[0].cancelled
    _assert_same_as_alone(cluster, agent, reference, "summarizer")


@needs_redis_wal
def test_a_replica_killed_mid_compaction_the_other_compacts_once(cluster_of: Callable[..., Cluster],
                                                                 trajectory: Any) -> None:
    """No speculation, so the Autocompact call runs inside the turn, under the session's lock."""
    cluster = cluster_of(summarizer=SLOW_SUMMARIZER, speculation=False)
    turns = _turns(_agent("pair", trajectory), trajectory)
    summaries_before: list[int] = []

    def alone(agent: Agent) -> None:
        for messages in turns:
            summaries_before.append(len(cluster.calls(SLOW_SUMMARIZER)))
            agent.whole(cluster.replicas["a"], messages)
    reference = _reference(cluster, trajectory, SLOW_SUMMARIZER, alone)
    compacting = [i for i in range(len(turns) - 1) if summaries_before[i + 1] > summaries_before[i]]
    assert len(compacting) >= 2, compacting
    kill_at = compacting[1]  # a compaction point is logged before it: its summary must not be asked again

    rng = random.Random(16)
    agent = _agent("pair", trajectory)
    for i, messages in enumerate(turns):
        if i != kill_at:
            agent.whole(cluster.replicas[rng.choice(sorted(cluster.replicas))], messages)
            continue
        cluster.upstream.slow_s = HELD_S
        with ThreadPoolExecutor(1) as pool:
            attempt = pool.submit(agent.whole, cluster.replicas["a"], messages)
            in_flight = wait_until(lambda: [c for c in cluster.upstream.chats()
                                            if c.body.get("model") == SLOW_SUMMARIZER and not c.done], 30,
                                   "the Autocompact call to be in flight")
            cluster.killed += in_flight
            cluster.kill("a")
            cluster.upstream.slow_s = 0.0
            with pytest.raises(openai.APIConnectionError):
                attempt.result(30)
        # The dead replica held the session's lock: the survivor waits for it to lapse.
        agent.whole(cluster.replicas["b"], messages, timeout=150)
        cluster.relaunch("a").wait_ready()
    _assert_same_as_alone(cluster, agent, reference, SLOW_SUMMARIZER)


def test_redis_restarted_mid_session_503_then_no_turn_lost(cluster_of: Callable[..., Cluster],
                                                            trajectory: Any) -> None:
    """One replica (its log is where `ctxgate wal show` reads it with either WAL backend)."""
    cluster = cluster_of(replicas=("a",))
    gw = cluster.replicas["a"]
    turns = _turns(_agent("pair", trajectory), trajectory)
    down_at = len(turns) // 2

    def alone(agent: Agent) -> None:
        for messages in turns:
            cluster.between_turns(agent)
            agent.whole(gw, messages)
    reference = _reference(cluster, trajectory, "summarizer", alone)

    agent = _agent("pair", trajectory)
    for i, messages in enumerate(turns):
        cluster.between_turns(agent)
        if i == down_at:
            cluster.redis.kill()
            forwarded = len(cluster.upstream.chats())
            refused = httpx.post(f"{gw.url}/chat/completions", timeout=60, json={
                "model": MODEL, "messages": messages, "tools": agent.tools},
                headers={"Authorization": f"Bearer {KEYS['pair']}", **agent.headers()})
            assert_error_shape(refused, 503)
            assert len(cluster.upstream.chats()) == forwarded  # refused before anything was forwarded
            assert gw.get("/readyz") == (503, {"status": "state backend unreachable"})
            assert gw.get("/healthz")[0] == 200
            cluster.redis.restart()
            wait_until(lambda: gw.get("/readyz")[0] == 200, 30, "/readyz once Redis is back")
        agent.whole(gw, messages)
    cluster.between_turns(agent)
    _assert_same_as_alone(cluster, agent, reference, "summarizer")


async def test_a_live_holder_keeps_the_session_lock_past_its_lease(tmp_path: Path) -> None:
    """The lease only frees a session from a dead holder: one whose turn outlasts it renews it."""
    server = RedisServer.start(tmp_path)
    holder, waiter = (RedisSessionStore(server.url, lock_timeout_s=30, lock_lease_s=0.3) for _ in range(2))
    order: list[str] = []

    async def hold() -> None:
        async with holder.lock("pair", "long-turn"):
            order.append("first in")
            await asyncio.sleep(1.5)  # five leases
            order.append("first out")

    async def wait() -> None:
        await asyncio.sleep(0.1)
        async with waiter.lock("pair", "long-turn"):
            order.append("second in")

    try:
        await asyncio.gather(hold(), wait())
    finally:
        await holder.close()
        await waiter.close()
        server.stop()
    assert order == ["first in", "first out", "second in"]


def test_a_replica_says_at_start_when_memory_stays_on_its_own_disk(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path / "redis")
    specs = {store: (tmp_path / store, {"ctxgate": {"state": server.url, "memory": {"store": store}}})
             for store in ("files", "redis")}
    try:
        gws = start_gateways(specs)
        stop_all(gws.values())
    finally:
        server.stop()
    warning = "keeps long-term memory under this replica's data directory"
    assert warning in gws["files"].text() and warning not in gws["redis"].text()


def test_one_idempotency_key_on_two_replicas_at_once_is_forwarded_once(cluster_of: Callable[..., Cluster],
                                                                      trajectory: Any) -> None:
    """A client's retry that races its original (a timeout shorter than the reply) on another replica
    waits for it and is answered from its reply, as it would be on the same replica."""
    cluster = cluster_of()
    agent = _agent("pair", trajectory)
    messages = _turns(agent, trajectory)[0]
    key = "idem-" + uuid.uuid4().hex
    cluster.upstream.slow_s = 3.0  # the original is still waiting for its reply when the retry comes
    with ThreadPoolExecutor(2) as pool:
        original = pool.submit(agent.whole, cluster.replicas["a"], messages, key)
        wait_until(lambda: cluster.calls(MODEL), 30, "the original to be forwarded")
        retry = pool.submit(agent.whole, cluster.replicas["b"], messages, key)
        first, second = original.result(60), retry.result(60)
    assert len(cluster.calls(MODEL)) == 1
    assert first.content == second.content
    assert "idempotent-replayed" not in first.headers and second.headers["idempotent-replayed"] == "true"
