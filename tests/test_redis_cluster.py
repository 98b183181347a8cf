"""Redis Cluster as ctxgate's shared backend, against a real cluster of redis-server nodes.

- The URL: seed nodes, a masked password, errors that name the URL.
- At start: a cluster URL no node answers, a cluster URL naming a node not in cluster mode,
  and a one-node URL naming a cluster node are each refused with one clear line.
- Each store on three masters: a session's keys on one slot (its MULTI/EXEC and scripts
  run), sessions spread over every master, the WAL's list of logs read back from every shard.
- As it will be run: two ctxgate replicas on three masters with a replica each; three
  compacting sessions, one per master; turns on random replicas; a ctxgate replica killed
  with SIGKILL; the master of one session's slot killed and its replica promoted. Every
  acknowledged turn is in its log once and in order, the upstream receives what one replica
  alone sent for the same turns, and no summary is asked for twice.
- Split brain: a replica stopped mid-turn past its lease cannot write over the session the
  other replica carried on; its client gets a 503 in the OpenAI shape.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import openai
import pytest
import yaml

from ctxgate.memory.entries import Category, MemoryEntry
from ctxgate.memory.redis_short_term import RedisShortTermStore
from ctxgate.memory.redis_store import RedisMemoryStore
from ctxgate.memory.short_term import BufferScope, Candidate
from ctxgate.proxy.engine.content_store import RedisContentStore
from ctxgate.proxy.engine.redis_state import RedisSessionStore
from ctxgate.proxy.engine.state import CompactionRecord, SessionState
from ctxgate.redis_backend import RedisTarget, RedisUrlError
from ctxgate.wal.redis_log import RedisLog
from clients import assert_error_shape
from redis_cluster import RedisClusterNodes
from servers import RedisServer, free_port, run_ctxgate, start_gateways, stop_all, wait_until
from test_failover import MODEL, SLOW_SUMMARIZER, Agent, Cluster, _agent, _config, _logged, _turns
from trajectories import openhands
from upstream import ScriptedUpstream


# -- the URL ---------------------------------------------------------------------------------

def test_a_cluster_url_names_its_seed_nodes_and_masks_its_password() -> None:
    target = RedisTarget.parse("rediss+cluster://ops:s3cr%40t@10.0.0.1:7000,[::1]:7001")
    assert target.cluster and target.tls and target.nodes == (("10.0.0.1", 7000), ("::1", 7001))
    assert (target.username, target.password) == ("ops", "s3cr@t")
    assert target.masked == "rediss+cluster://ops:***@10.0.0.1:7000,[::1]:7001"
    assert RedisTarget.parse("redis://:pw@h:1/0").masked == "redis://:***@h:1/0"
    assert not RedisTarget.parse("redis://h:1/0").cluster


@pytest.mark.parametrize("url, says", [
    ("redis+cluster://:pw@h:1,h", "each cluster node is host:port"),
    ("redis+cluster://:pw@h:1/2", "one database, 0"),
    ("memcached://h:1", "is not a Redis URL"),
])
def test_a_bad_cluster_url_is_refused_by_name(url: str, says: str) -> None:
    with pytest.raises(RedisUrlError) as e:
        RedisTarget.parse(url)
    assert says in str(e.value) and "pw" not in str(e.value)


def test_one_session_one_tag_and_sessions_over_every_shard() -> None:
    target = RedisTarget.parse("redis+cluster://h:1")
    assert target.tag("acme", "s-1") == target.tag("acme", "s-1") != ""
    tags = {target.tag("acme", f"s-{i}") for i in range(5000)}
    assert tags == set(target.shard_tags())  # every shard used: nothing piles on one slot
    assert RedisTarget.parse("redis://h:1").tag("acme", "s-1") == ""  # one node: the names it always had


# -- at start --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def masters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    cluster = RedisClusterNodes.start(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.stop()


def _refusal(tmp_path: Path, upstream: ScriptedUpstream, **ctxgate: Any) -> str:
    config = _config(upstream, "memory", "summarizer", speculation=False)
    config["ctxgate"].update(ctxgate)
    path = tmp_path / "ctxgate.yaml"
    path.write_text(yaml.safe_dump(config))
    done = run_ctxgate(["serve", "--config", str(path), "--port", str(free_port()), "--data-dir",
                        str(tmp_path / "data")], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctxgate: refusing to start:"), done.stderr
    return lines[0]


def test_a_cluster_no_node_answers_is_refused_with_its_url_masked(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    url = f"redis+cluster://:hunter2@127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    line = _refusal(tmp_path, upstream, state=url)
    assert "no cluster node answered" in line and "hunter2" not in line and ":***@127.0.0.1" in line


def test_a_cluster_url_naming_a_plain_redis_is_refused(tmp_path: Path, upstream: ScriptedUpstream,
                                                       redis_server: RedisServer) -> None:
    line = _refusal(tmp_path, upstream, state=f"redis+cluster://127.0.0.1:{redis_server.port}")
    assert "is not in cluster mode" in line and "redis://host:port" in line


def test_a_plain_url_naming_a_cluster_node_is_refused(tmp_path: Path, upstream: ScriptedUpstream,
                                                      masters: RedisClusterNodes) -> None:
    line = _refusal(tmp_path, upstream, state=f"redis://127.0.0.1:{masters.nodes[0].port}/0")
    assert "is a node of a Redis Cluster" in line and "redis+cluster://" in line


def test_state_on_the_cluster_and_the_log_on_a_plain_redis_works(tmp_path: Path, upstream: ScriptedUpstream,
                                                                 masters: RedisClusterNodes,
                                                                 redis_server: RedisServer) -> None:
    """A mixed config is two independent backends: each is checked and used as what it is."""
    config = _config(upstream, masters.url, "summarizer", speculation=False)
    config["ctxgate"]["wal"] = {"backend": "redis", "redis_url": redis_server.url}
    gw = start_gateways({"mixed": (tmp_path / "mixed", config)})["mixed"]
    try:
        agent = _agent("pair", _longest())
        agent.whole(gw, [{"role": "user", "content": "hello"}])
        log = RedisLog(redis_server.url)  # the suite's Redis: other tests' logs may be there too
        assert agent.session in [i.session for i in log.sessions("pair")]
        log.close()
        on_cluster = RedisLog(masters.url)
        assert agent.session not in [i.session for i in on_cluster.sessions("pair")]  # the log is not beside the state
        on_cluster.close()
    finally:
        stop_all([gw])


def _longest() -> Any:
    return max(openhands(), key=lambda t: len(t.messages))


@pytest.fixture(scope="module")
def longest() -> Any:
    return _longest()


# -- each store on three masters --------------------------------------------------------------

def _spread(cluster: RedisClusterNodes, target: RedisTarget, count: int, tenant: str = "acme") -> list[str]:
    """Session ids of `tenant` whose tags fall on every master."""
    found: dict[int, list[str]] = {}
    i = 0
    while len(found) < len(cluster.nodes) or min(len(v) for v in found.values()) < count:
        session = f"s-{i}"
        i += 1
        found.setdefault(cluster.master_of(target.tag(tenant, session) + "x").port, []).append(session)
    return [s for sessions in found.values() for s in sessions[:count]]


async def test_session_state_saves_loads_locks_and_lists_on_the_cluster(masters: RedisClusterNodes) -> None:
    store = RedisSessionStore(masters.url)
    tenant = "t-" + uuid.uuid4().hex[:8]  # the module's cluster also holds other tests' sessions
    sessions = _spread(masters, RedisTarget.parse(masters.url), 2, tenant)
    for n, session in enumerate(sessions):
        async with store.lock(tenant, session):
            state = SessionState(tenant, session, turns=n)
            state.add_record(CompactionRecord(3, "h", [{"role": "user", "content": "x" * 100}], ["snip"], 9, 3, 1.0))
            state.memory_block = "remembered"
            await store.save(state)
    other = RedisSessionStore(masters.url)  # another replica
    for n, session in enumerate(sessions):
        loaded = await other.load(tenant, session)
        assert loaded is not None and loaded.turns == n and loaded.records[0].messages[0]["content"] == "x" * 100
        assert loaded.memory_block == "remembered"
    assert sorted(s.session_id for s in await other.list(tenant)) == sorted(sessions)
    assert await other.list("nobody") == []
    await store.close()
    await other.close()


def test_the_log_appends_reads_archives_and_lists_over_every_shard(masters: RedisClusterNodes) -> None:
    log = RedisLog(masters.url, archive_every=1, wait_replicas=0)
    sessions = _spread(masters, RedisTarget.parse(masters.url), 2)
    record = {"prefix_len": 2, "prefix_hash": "h", "messages": [], "levels": ["snip"], "tokens_before": 5,
              "tokens_after": 2, "created_at": 1.0}
    for session in sessions:
        for n in range(3):
            log.append("acme", session, [{"type": "USER_INPUT", "turn": n, "index": n, "content_hash": "c"},
                                         {"type": "CHECKPOINT", "reason": "compaction",
                                          "state": {"records": [record]}}])
    assert sorted((i.tenant, i.session) for i in log.sessions()) == sorted(("acme", s) for s in sessions)
    for session in sessions:
        read = log.history("acme", session)
        seqs = [e["seq"] for scan in read.scans for e in scan.events]
        assert seqs == list(range(1, 7)) and len(read.scans) > 1  # archived, and read back in order
    log.close()


async def test_the_other_stores_keep_a_tenant_or_session_on_one_slot(masters: RedisClusterNodes) -> None:
    content = RedisContentStore(masters.url)
    await content.put("acme", "s-1", {"r1": "one", "r2": "two"}, max_bytes=3, ttl_s=60)
    assert await content.get("acme", "s-1", "r1", 60) is None and await content.get("acme", "s-1", "r2", 60) == "two"
    await content.close()
    memory = RedisMemoryStore(masters.url)
    entry = MemoryEntry(tenant="acme", category=Category.PROJECT, content="the build runs with make", id="m1")
    await memory.put(entry)
    assert [e.id for e in await memory.list("acme")] == ["m1"] and await memory.delete("acme", "m1")
    await memory.close()
    a, b = RedisShortTermStore(masters.url), RedisShortTermStore(masters.url)  # two replicas
    tenant = "st-" + uuid.uuid4().hex[:8]
    sessions = _spread(masters, RedisTarget.parse(masters.url), 1, tenant)
    scope = BufferScope("u1", None, "enterprise", "gpt-4o")
    for session in sessions:
        await a.add((tenant, session), scope, ["f0"], [(0, Candidate(Category.USER, f"taught in {session}"))], 10.0)
    assert sorted(s for t, s in await b.idle(100.0, 1.0) if t == tenant) == sorted(sessions)
    for session in sessions:
        _, taken = await b.drain((tenant, session), 100.0)
        assert [c.content for c in taken] == [f"taught in {session}"]
        await b.forget((tenant, session), 10.0)
    assert [s for t, s in await a.idle(100.0, 1.0) if t == tenant] == []
    await a.close()
    await b.close()


# -- as it will be run --------------------------------------------------------------------------

@dataclass
class ClusterAgent(Agent):
    """An agent of a tenant of its own: nothing one learns (memory) reaches another's requests."""

    model: str = MODEL

    def sdk(self, gw: Any, timeout: float = 60.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=gw.url, api_key=f"sk-{self.tenant}", max_retries=0, timeout=timeout)

    def whole(self, gw: Any, messages: list[dict[str, Any]], idempotency_key: str | None = None,
              timeout: float = 60.0) -> Any:
        raw = self.sdk(gw, timeout).chat.completions.with_raw_response.create(
            model=self.model, messages=messages, tools=self.tools, extra_headers=self.headers(idempotency_key))
        self.acknowledged += 1
        return raw.http_response


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def start(replicas: int, summarizer: str = "summarizer", speculation: bool = True) -> Cluster:
        up = ScriptedUpstream(slow_s=0.0).start()
        nodes = RedisClusterNodes.start(tmp_path / "redis", replicas=replicas)
        config = _config(up, nodes.url, summarizer, speculation)
        tenants = ["alone", *(f"pair{i}" for i in range(3))]
        config["ctxgate"]["tenants"] = {t: {"api_keys": [f"sk-{t}"], "allow_overrides": ["budget"]} for t in tenants}
        # Every append acknowledged by the slot's replica: a promoted replica has every acknowledged turn.
        config["ctxgate"]["wal"] |= {"redis_wait_replicas": replicas}
        gws = start_gateways({name: (tmp_path / name, config) for name in ("a", "b")})
        made.append(Cluster(up, nodes, gws, tmp_path, tmp_path / "no-disk"))
        return made[-1]

    yield start
    for cluster in made:
        cluster.stop()


def _agents(nodes: RedisClusterNodes, longest: Any) -> list[ClusterAgent]:
    """One compacting session per master."""
    target, agents, taken = RedisTarget.parse(nodes.url), [], set()
    budget = _agent("x", longest).budget
    while len(agents) < 3:
        tenant, session = f"pair{len(agents)}", f"s-{uuid.uuid4().hex[:8]}"
        master = nodes.master_of(target.tag(tenant, session) + "x").port
        if master not in taken:
            taken.add(master)
            agents.append(ClusterAgent(tenant, session, budget, longest.tools))
    return agents


def test_two_replicas_on_a_cluster_survive_a_replica_kill_and_a_master_failover(
        fleet: Callable[..., Cluster], longest: Any) -> None:
    cluster = fleet(1)
    nodes = cluster.redis
    assert isinstance(nodes, RedisClusterNodes)
    turns = _turns(_agent("x", longest), longest)
    alone = ClusterAgent("alone", f"alone-{uuid.uuid4().hex[:8]}", _agent("x", longest).budget, longest.tools)
    for messages in turns:
        cluster.between_turns(alone)
        alone.whole(cluster.replicas["a"], messages)
    cluster.between_turns(alone)
    reference_turns = [c.raw for c in cluster.calls(MODEL)]
    reference_summaries = Counter(c.raw for c in cluster.calls("summarizer"))
    reference_log = _logged(cluster.wal(alone))
    assert reference_log["compactions"] >= 2 and reference_log["responses"] == len(turns)
    cluster.upstream.reset()

    agents = _agents(nodes, longest)
    target = RedisTarget.parse(nodes.url)
    kill_at, failover_at = len(turns) // 3, 2 * len(turns) // 3
    rng = random.Random(26)
    for i, messages in enumerate(turns):
        for agent in agents:
            cluster.between_turns(agent)
        if i == kill_at:
            cluster.kill("a")
            cluster.relaunch("a").wait_ready()
        if i == failover_at:  # the master of the first session's slot dies; its replica takes over
            old = nodes.master_of(target.tag(agents[0].tenant, agents[0].session) + "x")
            nodes.fail_over(old)
            # The promoted master has no replica yet: an append cannot be acknowledged, and the
            # turn is refused with a clean 503 before anything is forwarded.
            with pytest.raises(openai.APIStatusError) as refused:
                agents[0].whole(cluster.replicas["b"], messages)
            assert_error_shape(refused.value.response, 503)
            agents[0].acknowledged -= 1 if refused.value.response.is_success else 0
            nodes.rejoin(old)  # as the new master's replica: appends are acknowledged again
        for agent in agents:  # turn i of every session, each on a replica picked at random
            agent.whole(cluster.replicas[rng.choice("ab")], messages, timeout=120)
    for agent in agents:
        cluster.between_turns(agent)

    # Each session's turn i went up once per session, in step: the reference's bytes, three times.
    assert [c.raw for c in cluster.calls(MODEL)] == [raw for raw in reference_turns for _ in agents]
    assert Counter(c.raw for c in cluster.calls("summarizer")) == Counter(
        {raw: n * len(agents) for raw, n in reference_summaries.items()}), "a summary paid twice, or one missing"
    for agent in agents:
        logged = _logged(cluster.wal(agent))
        assert logged == reference_log and logged["responses"] == agent.acknowledged == len(turns)


def test_a_replica_cut_off_past_its_lease_cannot_overwrite_the_session(
        fleet: Callable[..., Cluster], longest: Any) -> None:
    """Replica a is stopped (SIGSTOP: cut off from everything) while its Autocompact call is in
    flight, under the session's lock; b takes the session over once the lease lapses and
    carries it on; then a wakes up with its summary and tries to commit."""
    cluster = fleet(0, summarizer=SLOW_SUMMARIZER, speculation=False)
    a, b = cluster.replicas["a"], cluster.replicas["b"]
    agent = ClusterAgent("pair0", f"s-{uuid.uuid4().hex[:8]}", _agent("x", longest).budget, longest.tools,
                         model="gpt-4o")
    turns = _turns(agent, longest)
    cluster.upstream.slow_s = 3.0
    pool = ThreadPoolExecutor(1)
    try:
        for i, messages in enumerate(turns):
            attempt = pool.submit(agent.whole, a, messages, None, 120)
            wait_until(lambda: attempt.done() or cluster.calls_in_flight(SLOW_SUMMARIZER), 60,
                       "the turn to end or its summary to be asked for")
            if cluster.calls_in_flight(SLOW_SUMMARIZER):  # held 3 s: still in flight
                break
            attempt.result()
        else:
            pytest.fail("no turn compacted")
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(11)  # past the lease (10 s): the lock lapses
            cluster.upstream.slow_s = 0.0
            agent.whole(b, messages)
            agent.whole(b, turns[i + 1])
            carried_on = asyncio.run(_state(cluster.redis.url, agent))
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        with pytest.raises(openai.APIStatusError) as refused:
            attempt.result(60)
    finally:
        pool.shutdown(wait=False)
    assert_error_shape(refused.value.response, 503, "session_lease_lost")
    after = asyncio.run(_state(cluster.redis.url, agent))
    assert (after.turns, after.answered_turns, after.wal_seq, len(after.records)) == (
        carried_on.turns, carried_on.answered_turns, carried_on.wal_seq, len(carried_on.records))
    assert after.answered_turns == i + 2
    responses = [e for e in cluster.wal(agent) if e["type"] == "RESPONSE"]
    assert len(responses) == i + 2  # a's turns before the stop, then b's two; nothing of a's stale one


async def _state(url: str, agent: Agent) -> SessionState:
    store = RedisSessionStore(url)
    try:
        state = await store.load(agent.tenant, agent.session)
    finally:
        await store.close()
    assert state is not None
    return state


def test_a_background_compaction_is_paid_once_whichever_replica_the_next_turn_reaches(
        fleet: Callable[..., Cluster], longest: Any) -> None:
    """Each summary takes a second and the turns alternate between the replicas, so the
    background compaction a turn starts on one replica is still running when the next turn
    reaches the other: that replica neither starts it again nor compacts on its own at the
    trigger; it waits for the first one's result and adopts it. Counted at the upstream:
    no summary request is sent twice."""
    cluster = fleet(0, summarizer=SLOW_SUMMARIZER, speculation=True)
    cluster.upstream.slow_s = 1.0
    agent = ClusterAgent("pair0", f"s-{uuid.uuid4().hex[:8]}", _agent("x", longest).budget, longest.tools,
                         model="gpt-4o")
    for i, messages in enumerate(_turns(agent, longest)):
        agent.whole(cluster.replicas["ab"[i % 2]], messages, timeout=150)
    cluster.between_turns(agent)
    summaries = Counter(c.raw for c in cluster.calls(SLOW_SUMMARIZER))
    assert summaries and max(summaries.values()) == 1, "a summary paid twice"
    state = asyncio.run(_state(cluster.redis.url, agent))
    assert [e for e in state.compaction_log if e["level"] == "speculative"], "no background compaction adopted"
