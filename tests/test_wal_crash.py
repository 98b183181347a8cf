"""Crash tests: a real `ctxgate serve` killed with SIGKILL at random moments while real
clients (the openai SDK, several sessions at once, some streaming) replay recorded agent
runs turn by turn, restarted on the same data directory each time.

Next to it a control gateway (same config, its own data directory, same upstream, never
killed) serves the same sessions. The two gateways' upstream calls are told apart by the
upstream key each one is configured with, and each turn by the `user` field the client
sends (it passes through untouched, the same in both). The bars, from the WAL issue:

(a) every turn whose reply reached the client has its USER_INPUT / TOOL_RESULT events in
    the log, each message exactly once, seqs strictly increasing;
(b) after every kill, `ctxgate wal verify --json` parses every log: no damaged line, torn
    last lines reported (exit 0), and set aside by the restarted gateway;
(c) every payload the killed gateway forwarded, the turns right after a restart included,
    is byte-identical to the control's for the same session and turn;
(d) no Autocompact summary is asked for again once its compaction was logged.

A second test sends many simultaneous requests in one session and checks the log's seqs
and its USER_INPUT counts.

Speculative Autocompact (a summary made in the background) is switched off in the
crash-under-load test: a kill while one is in flight is the subject of its own test.
"""
from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from ctxgate.pipeline.fingerprint import message_fingerprint, prefix_hashes
from clients import agent_turns, client, feasible_turns
from servers import LIVE, Gateway, launch, model_list, run_ctxgate, start_gateways, stop_all, wait_until
from trajectories import Trajectory, openhands
from upstream import ScriptedUpstream

SEED = 20261203
"""Kill moments, torn-line simulation: all drawn from this seed, so a failure reproduces
(as far as the scheduler allows)."""
BUDGET = 6000
"""X-Ctx-Budget: small enough that every replayed run compacts several times."""
MAX_KILLS = 10
CRASH_KEY, CONTROL_KEY = "sk-up-crash", "sk-up-control"
KEYS_OF = {"crash": CRASH_KEY, "control": CONTROL_KEY}
SESSIONS = ("python__mypy-15976_0", "Project-MONAI__MONAI-6849_1", "getmoto__moto-6387_0",
            "Project-MONAI__MONAI-3715_4")
STREAMING = {"Project-MONAI__MONAI-6849_1", "getmoto__moto-6387_0"}


def gateway_config(upstream_url: str, upstream_key: str, **pipeline: Any) -> dict[str, Any]:
    """The config both gateways share, but for the key they present upstream."""
    models = [{**m, "litellm_params": {**m["litellm_params"], "api_key": upstream_key}}
              for m in model_list(upstream_url)]
    models.append({"model_name": "slow-summarizer", "model_info": {"max_input_tokens": 128_000}, "litellm_params": {
        "model": "openai/slow-summarizer", "api_base": f"{upstream_url}/v1", "api_key": upstream_key}})
    autocompact = {"model": "summarizer", "speculative_ratio": None, **pipeline.pop("autocompact", {})}
    # Memory off: its short-term buffer lives in the process, so a killed gateway's would be
    # consolidated by nobody while the control's is at shutdown: other summarizer calls.
    return {"model_list": models, "ctxgate": {"forwarding": "auto", "max_body_bytes": 4_000_000,
                                               "memory": {"enabled": False},
                                               "tenants": {t: {"allow_overrides": ["budget"]}
                                                           for t in ("control", "crash")},
                                               "pipeline": {"autocompact": autocompact, **pipeline}}}


def turns_of(t: Trajectory) -> list[list[dict[str, Any]]]:
    """The requests the agent sent before its replies, those the budget can serve."""
    return feasible_turns(agent_turns(t.messages), BUDGET)


def trajectory(name: str) -> Trajectory:
    return next(t for t in openhands() if t.name == f"openhands/{name}")


# -- reading what the gateways left behind -----------------------------------------------


def log_files(data_dir: Path, tenant: str, session: str) -> list[Path]:
    """A session's log as files, oldest first: archive segments (by first seq), then the live file."""
    archived = sorted((data_dir / "wal_archive" / tenant).glob(f"wal_{session}.*-*.jsonl"),
                      key=lambda p: int(p.name[len(f"wal_{session}."):].split("-")[0]))
    return [*archived, data_dir / "wal" / tenant / f"wal_{session}.jsonl"]


def events_of(data_dir: Path, tenant: str, session: str) -> list[dict[str, Any]]:
    """Every complete line of the session's files, parsed here (not with ctxgate's reader)."""
    out = []
    for f in log_files(data_dir, tenant, session):
        if f.exists():
            data = f.read_bytes()
            out += [json.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines() if line.strip()]
    return out


def verify(data_dir: Path, cwd: Path) -> tuple[int, dict[str, Any]]:
    done = run_ctxgate(["wal", "verify", "--data-dir", str(data_dir), "--json"], cwd)
    assert done.stdout.strip(), f"wal verify printed nothing (exit {done.returncode}): {done.stderr[-2000:]}"
    return done.returncode, json.loads(done.stdout)


def torn_on_disk(data_dir: Path) -> set[str]:
    return {str(f) for f in (data_dir / "wal").glob("*/wal_*.jsonl")
            if (raw := f.read_bytes()) and not raw.endswith(b"\n")}


def upstream_calls(up: ScriptedUpstream, key: str, model: str) -> list[tuple[int, Any]]:
    """(position in the upstream's log, entry) of the calls a gateway made for `model`."""
    return [(i, r) for i, r in enumerate(list(up.log)) if r.path.endswith("/chat/completions")
            and r.headers.get("authorization") == f"Bearer {key}" and isinstance(r.body, dict)
            and r.body.get("model") == model]


# -- the clients -------------------------------------------------------------------------


class Current:
    """The gateway the clients should talk to now, and its generation (restarts so far)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw, self.generation = gw, 0
        self._cond = threading.Condition()

    def get(self) -> tuple[int, Gateway]:
        with self._cond:
            return self.generation, self.gw

    def publish(self, gw: Gateway) -> None:
        with self._cond:
            self.gw, self.generation = gw, self.generation + 1
            self._cond.notify_all()

    def wait_newer(self, generation: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.generation > generation, timeout)


class Permits:
    """Paces clients by count, not by time: each attempt takes a permit, and the test hands out
    a generation's worth between two kills, so the run holds as many kills however fast or
    loaded the machine is."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.granted = self.taken = 0
        self.unlimited = False

    def grant(self, n: int) -> int:
        """`n` more attempts may start; returns how many will have started once they have."""
        with self._cond:
            self.granted += n
            self._cond.notify_all()
            return self.granted

    def release_all(self) -> None:
        with self._cond:
            self.unlimited = True
            self._cond.notify_all()

    def take(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.unlimited or self.taken < self.granted)
            self.taken += 1


@dataclass
class Attempt:
    turn: int
    generation: int
    ok: bool
    levels: str = ""


@dataclass
class Replay:
    """One session replayed turn by turn; a turn whose reply did not arrive is sent again."""
    name: str
    tenant: str
    turns: list[list[dict[str, Any]]]
    tools: list[dict[str, Any]] | None
    stream: bool
    attempts: list[Attempt] = field(default_factory=list)
    failure: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def completed(self) -> int:
        return sum(1 for a in self.attempts if a.ok)

    def send(self, gw: Gateway, k: int) -> dict[str, str]:
        cli = client(gw, "sk-client")
        raw = cli.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=self.turns[k], tools=self.tools, user=f"{self.name}:{k}", stream=self.stream,
            extra_headers={"X-Ctx-Budget": str(BUDGET), "X-Ctx-Session": self.name, "X-Ctx-Tenant": self.tenant})
        if self.stream:
            chunks = list(raw.parse())  # a kill mid-stream raises here
            assert any(c.choices and c.choices[0].finish_reason for c in chunks), "stream ended without a finish"
        else:
            assert raw.parse().choices[0].message.content == "ok"
        return dict(raw.headers)

    def run(self, current: Current, permits: Permits | None = None) -> None:
        k = 0
        try:
            while k < len(self.turns):
                if permits is not None:
                    permits.take()
                generation, gw = current.get()
                try:
                    levels = self.send(gw, k).get("x-ctx-levels", "")
                except (openai.APIConnectionError, httpx.HTTPError):
                    self.attempts.append(Attempt(k, generation, False))
                    current.wait_newer(generation, timeout=60)
                    continue
                self.attempts.append(Attempt(k, generation, True, levels))
                k += 1
        except Exception as e:  # an answer that is not a lost connection: the test fails on it
            self.failure = f"{self.name} turn {k}: {type(e).__name__}: {e}"
        finally:
            self.done.set()


def replays(tenant: str) -> list[Replay]:
    return [Replay(name, tenant, turns_of(trajectory(name)), trajectory(name).tools, name in STREAMING)
            for name in SESSIONS]


def start_clients(sessions: list[Replay], current: Current, permits: Permits | None = None) -> list[threading.Thread]:
    threads = [threading.Thread(target=s.run, args=(current, permits), name=f"client-{s.name}", daemon=True)
               for s in sessions]
    for t in threads:
        t.start()
    return threads


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    up = ScriptedUpstream(limit=BUDGET, slow_s=1.5).start()
    yield up
    up.stop()


# -- the tests ---------------------------------------------------------------------------


def test_sigkill_under_load_loses_no_turn_and_changes_no_payload(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    upstream.reset()
    workdir = tmp_path / "crash"
    config = gateway_config(upstream.url, CRASH_KEY)
    # The recorded runs first: without them the test skips, and must not leave gateways running.
    control_sessions, crash_sessions = replays("control"), replays("crash")
    started = start_gateways({"crash": (workdir, config),
                              "control": (tmp_path / "control", gateway_config(upstream.url, CONTROL_KEY))})
    crash, control = started["crash"], started["control"]
    data_dir = crash.data_dir
    assert data_dir is not None and control.data_dir is not None

    control_threads = start_clients(control_sessions, Current(control))
    current = Current(crash)
    # A generation's worth of attempts between two kills: the sessions cannot end before
    # MAX_KILLS kills, whatever the machine's speed (a retried attempt takes a permit too).
    permits = Permits()
    per_generation = max(1, sum(len(s.turns) for s in crash_sessions) // (MAX_KILLS + 2))
    crash_threads = start_clients(crash_sessions, current, permits)

    kills: list[int] = []
    """The upstream log's length when each kill had taken effect."""
    restarted_at: list[dict[str, int]] = []
    """Per kill: how many turns each session had completed."""
    torn_by_test: dict[str, bytes] = {}
    verified: list[dict[str, Any]] = []
    try:
        while len(kills) < MAX_KILLS and not all(s.done.is_set() for s in crash_sessions):
            started_by = permits.grant(per_generation)
            if rng.random() < 0.25:  # right after the restart: recovery and the first turns in flight
                time.sleep(rng.uniform(0.0, 0.3))
            else:  # mid-run: this generation's attempts started, some answered first
                wait_until(lambda: permits.taken >= started_by or all(s.done.is_set() for s in crash_sessions), 120,
                           "this generation's attempts to start")
                time.sleep(rng.uniform(0.0, 0.5))
            if all(s.done.is_set() for s in crash_sessions):
                break
            crash.proc.send_signal(signal.SIGKILL)
            crash.proc.wait(10)
            LIVE.remove(crash)
            crash.output.rename(workdir / f"ctxgate.{len(kills)}.log")  # what each generation printed is kept
            kills.append(len(upstream.log))
            restarted_at.append({s.name: s.completed for s in crash_sessions})

            unfinished = sorted(s.name for s in crash_sessions if not s.done.is_set()
                                and (data_dir / "wal" / "crash" / f"wal_{s.name}.jsonl").exists())
            if unfinished and rng.random() < 0.3:
                # What a power cut leaves that SIGKILL does not: the start of an event line, no newline.
                live = data_dir / "wal" / "crash" / f"wal_{rng.choice(unfinished)}.jsonl"
                if live.read_bytes().endswith(b"\n"):
                    fragment = b'{"seq":%d,"type":"USER_INPUT","timestamp":"2026-' % (10**6 + len(kills))
                    with open(live, "ab") as fh:
                        fh.write(fragment)
                    torn_by_test[str(live)] = fragment

            code, report = verify(data_dir, workdir)
            verified.append(report)
            assert code == 0 and report["damaged_lines"] == 0, f"kill {len(kills)}: damage reported: {report}"
            reported_torn = {f["file"] for f in report["files"] if f["torn_bytes"]}
            assert reported_torn == torn_on_disk(data_dir), (reported_torn, torn_on_disk(data_dir))
            assert report["torn_files"] == len(reported_torn)

            crash = launch("crash", workdir, config).wait_ready()
            current.publish(crash)
        permits.release_all()
        for t in [*crash_threads, *control_threads]:
            t.join(180)
    finally:
        permits.release_all()
        stop_all([crash, control])
    failures = [s.failure for s in [*crash_sessions, *control_sessions] if s.failure]
    assert not failures, failures
    assert all(s.completed == len(s.turns) for s in [*crash_sessions, *control_sessions])
    assert all(a.ok for s in control_sessions for a in s.attempts), "the control, never killed, lost a reply"
    assert len(kills) >= 6, f"only {len(kills)} kills happened: the run was too short to test anything"

    # (b) the torn lines were reported (above) and set aside by the restarted gateway: none is left.
    assert any(r["torn_files"] for r in verified) == bool(torn_by_test)
    code, final = verify(data_dir, workdir)
    assert code == 0 and final["damaged_lines"] == 0 and final["torn_files"] == 0, final
    for path, fragment in torn_by_test.items():
        assert fragment in Path(path + ".torn").read_bytes(), f"the torn fragment of {path} was not set aside"

    # (a) every turn answered has its messages in the log, each exactly once; seqs increase.
    for s in crash_sessions:
        events = events_of(data_dir, "crash", s.name)
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(set(seqs)), f"{s.name}: seqs not strictly increasing: {seqs}"
        logged = Counter((e["index"], e["prefix_hash"]) for e in events if e["type"] in ("USER_INPUT", "TOOL_RESULT"))
        last = s.turns[-1]
        hashes = prefix_hashes(message_fingerprint(m) for m in last)
        wanted = Counter((i, hashes[i]) for i, m in enumerate(last) if m["role"] in ("user", "tool"))
        assert logged == wanted, (f"{s.name}: messages missing from the log: {sorted(set(wanted) - set(logged))}, "
                                  f"logged twice: {[k for k, n in logged.items() if n > 1]}, "
                                  f"unknown: {sorted(set(logged) - set(wanted))}")
        responses = sum(1 for e in events if e["type"] == "RESPONSE")
        # A streamed reply reaches the client before its RESPONSE is logged (see the streaming test below).
        assert s.stream or responses >= len(s.turns), (f"{s.name}: {responses} RESPONSE events for "
                                           f"{len(s.turns)} turns answered; "
                                           f"attempts (turn, generation, ok): "
                                           f"{[(a.turn, a.generation, a.ok) for a in s.attempts]}")

    # (c) byte-identical payloads, every turn, the ones right after a restart included.
    control_payloads: dict[str, list[bytes]] = defaultdict(list)
    crash_payloads: dict[str, list[bytes]] = defaultdict(list)
    for _, r in upstream_calls(upstream, CONTROL_KEY, "gpt-4o"):
        control_payloads[r.body["user"]].append(r.raw)
    for _, r in upstream_calls(upstream, CRASH_KEY, "gpt-4o"):
        crash_payloads[r.body["user"]].append(r.raw)
    assert set(crash_payloads) == set(control_payloads)
    for tag, sent in control_payloads.items():
        assert len(sent) == 1, f"{tag}: the control forwarded {len(sent)} payloads for one turn"
        different = [i for i, raw in enumerate(crash_payloads[tag]) if raw != sent[0]]
        assert not different, f"{tag}: the killed gateway forwarded a different payload (attempts {different})"
    after_restart = set()  # (session, turn) of each session's first request to each restarted gateway
    for s in crash_sessions:
        for g in range(1, len(kills) + 1):
            first = next((a for a in s.attempts if a.generation == g), None)
            if first is not None:
                after_restart.add((s.name, first.turn))
    control_levels = {s.name: [a.levels for a in s.attempts] for s in control_sessions}
    compacted_before = [(n, k) for n, k in after_restart if any(lv != "none" for lv in control_levels[n][:k])]
    assert len(after_restart) >= len(kills), after_restart
    assert compacted_before, "no restart came after a compaction: recovery of compaction records was not exercised"

    # (d) one summary per compaction point: a summary asked for again only when a kill interrupted it.
    control_summaries = Counter(r.raw for _, r in upstream_calls(upstream, CONTROL_KEY, "summarizer"))
    crash_summaries: dict[bytes, list[int]] = defaultdict(list)
    for i, r in upstream_calls(upstream, CRASH_KEY, "summarizer"):
        crash_summaries[r.raw].append(i)
    assert control_summaries and set(crash_summaries) == set(control_summaries)
    assert set(control_summaries.values()) == {1}
    for raw, positions in crash_summaries.items():
        for earlier, later in zip(positions, positions[1:]):
            assert any(earlier < k <= later for k in kills), \
                f"a summary was asked for twice ({earlier}, {later} in the upstream log) with no kill in between"
    for s in crash_sessions:
        def compressions(data: Path, tenant: str) -> list[tuple[Any, ...]]:
            return [(e["level"], e["input_tokens"], e["output_tokens"]) for e in events_of(data, tenant, s.name)
                    if e["type"] == "COMPRESSION"]
        assert compressions(data_dir, "crash") == compressions(control.data_dir, "control"), \
            f"{s.name}: the compactions logged differ from the control's (one redone after a restart?)"


# -- many requests at once in one session ------------------------------------------------


def _one_session_gateway(upstream: ScriptedUpstream, workdir: Path) -> Gateway:
    return start_gateways({"one-session": (workdir, gateway_config(upstream.url, CONTROL_KEY))})["one-session"]


def test_simultaneous_requests_in_one_session_get_unique_seqs_and_each_input_logged(
        upstream: ScriptedUpstream, tmp_path: Path) -> None:
    threads_n, rounds = 20, 3
    base = turns_of(trajectory("Project-MONAI__MONAI-5686_4"))[0]  # before the gateway: a skip leaves none running
    tools = trajectory("Project-MONAI__MONAI-5686_4").tools
    gw = _one_session_gateway(upstream, tmp_path / "gw")
    n = len(base) + 1  # the index of each request's new user message
    headers = {"X-Ctx-Session": "together", "X-Ctx-Tenant": "many"}

    def request(messages: list[dict[str, Any]], stream: bool) -> None:
        cli = client(gw, "sk-client").with_options(timeout=60)
        if stream:
            chunks = list(cli.chat.completions.create(model="gpt-4o", messages=messages, tools=tools, stream=True,
                                                      extra_headers=headers))
            assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        else:
            assert cli.chat.completions.create(model="gpt-4o", messages=messages, tools=tools,
                                               extra_headers=headers).choices[0].message.content == "ok"

    def sibling(r: int, j: int) -> list[dict[str, Any]]:
        return [*base, {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"round {r}, thread {j}"}]

    shared = [*base, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "the same for all"}]
    waves = [[sibling(r, j) for j in range(threads_n)] for r in range(rounds)] + [[shared] * threads_n]
    errors: list[str] = []
    try:
        for wave in waves:
            barrier = threading.Barrier(threads_n)

            def run(j: int, messages: list[dict[str, Any]]) -> None:
                try:
                    barrier.wait(30)
                    request(messages, stream=j % 3 == 0)
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")

            workers = [threading.Thread(target=run, args=(j, m)) for j, m in enumerate(wave)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(120)
            assert not any(w.is_alive() for w in workers), "a request never finished"
    finally:
        gw.stop()
    assert not errors, errors

    events = events_of(gw.data_dir, "many", "together")
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, len(events) + 1)), "seqs are 1, 2, 3, ...: none skipped, none written twice"
    inputs = [e for e in events if e["type"] == "USER_INPUT"]

    def times_logged(messages: list[dict[str, Any]], i: int) -> int:
        h = prefix_hashes(message_fingerprint(m) for m in messages)[i]
        return sum(1 for e in inputs if e["index"] == i and e["prefix_hash"] == h)

    for r in range(rounds):
        for j in range(threads_n):
            assert times_logged(sibling(r, j), n) == 1, f"round {r} thread {j}: its new message not logged once"
    assert times_logged(shared, n) == 1, "twenty identical requests: their one new message logged once"
    # Every sibling rewrote what the log had seen last, so each logged the whole history again;
    # of the identical requests only the first did.
    task = next(i for i, m in enumerate(base) if m["role"] == "user")
    assert times_logged(base, task) == rounds * threads_n + 1
    # One request's events are written together, never interleaved with another's.
    by_turn: dict[int, list[int]] = defaultdict(list)
    for e in events:
        if e["type"] in ("USER_INPUT", "TOOL_RESULT"):
            by_turn[e["turn"]].append(e["seq"])
    assert len(by_turn) == rounds * threads_n + 1
    for turn, turn_seqs in by_turn.items():
        assert turn_seqs == list(range(turn_seqs[0], turn_seqs[0] + len(turn_seqs))), f"turn {turn}: {turn_seqs}"
    non_streamed = sum(1 for wave in waves for j in range(len(wave)) if j % 3)
    assert sum(1 for e in events if e["type"] == "RESPONSE") >= non_streamed


# -- a streamed reply and its RESPONSE event ---------------------------------------------


def test_every_streamed_reply_the_sdk_read_is_logged(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """The openai SDK closes the connection as soon as it reads `data: [DONE]`; the turn's
    RESPONSE event (and the loop-guard reset, and an Idempotency-Key's stored reply) must
    not depend on the handler outliving that. No kill here: a race, so many turns."""
    turns = 120
    gw = _one_session_gateway(upstream, tmp_path / "gw")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Start."}]
    try:
        for i in range(turns):
            cli = client(gw, "sk-client").with_options(timeout=60)
            messages = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"Step {i}."}]
            chunks = list(cli.chat.completions.create(model="gpt-4o", messages=messages, stream=True,
                                                      extra_headers={"X-Ctx-Session": "streamed", "X-Ctx-Tenant": "s"}))
            assert chunks[-1].choices[0].finish_reason == "stop"
    finally:
        gw.stop()
    events = events_of(gw.data_dir, "s", "streamed")
    assert sum(1 for e in events if e["type"] == "USER_INPUT") == turns + 1
    responses = sum(1 for e in events if e["type"] == "RESPONSE")
    assert responses == turns, f"{turns - responses} of {turns} streamed replies read by the client have no RESPONSE"


# -- a kill while a speculative summary is being made --------------------------------------


@pytest.mark.parametrize("moment", ["summary in flight", "summary kept"])
def test_a_kill_around_a_speculative_summary_changes_no_payload(upstream: ScriptedUpstream, tmp_path: Path,
                                                                moment: str) -> None:
    """Speculative Autocompact starts the summary in the background once a session passes
    70% of its budget; the turn at the trigger (85%) adopts it. Kill the gateway while that
    summary is still being written upstream (`slow-summarizer` takes `slow_s`), or once it
    was kept (its `speculative` CHECKPOINT is in the log): the session must go on with the
    payloads the control forwards, and the summary must not be asked for twice once kept."""
    upstream.reset()
    name = "python__mypy-15976_0"
    t = trajectory(name)
    # Without Snip, which would free these spans alone with no summary to kill around; each
    # point aims at the profile's target (the cost model may keep a point to the cheap levels,
    # which pay no summary: nothing to kill around either).
    pipeline = {"levels": ["microcompact", "collapse", "autocompact"], "cost": {"depth": "target"},
                "autocompact": {"model": "slow-summarizer", "speculative_ratio": 0.7}}
    crash_cfg = gateway_config(upstream.url, CRASH_KEY, **pipeline)
    control_cfg = gateway_config(upstream.url, CONTROL_KEY, **pipeline)
    started = start_gateways({"crash": (tmp_path / "crash", crash_cfg), "control": (tmp_path / "control", control_cfg)})
    gws = dict(started)
    session = {gw: Replay(name, gw, turns_of(t), t.tools, stream=False) for gw in ("crash", "control")}
    killed_at: int | None = None

    def kept(which: str) -> bool:
        return any(e["type"] == "CHECKPOINT" and e.get("reason") == "speculative"
                   for e in events_of(gws[which].data_dir, which, name))

    def speculations(which: str) -> int:
        """Background compactions the session's log says were started (SPECULATION events)."""
        return sum(e["type"] == "SPECULATION" for e in events_of(gws[which].data_dir, which, name))

    try:
        for k in range(len(session["crash"].turns)):
            started_one = False
            for which in ("control", "crash"):
                before = speculations(which)
                session[which].send(gws[which], k)
                started_one = speculations(which) > before
                if started_one and moment == "summary kept":  # the next turn finds it kept, in both gateways
                    # A history that is all recent window gives a speculation nothing to do: none is kept.
                    deadline = time.monotonic() + 10
                    while not kept(which) and time.monotonic() < deadline:
                        time.sleep(0.05)
                    started_one = kept(which)
            if killed_at is not None or not started_one:
                continue
            if moment == "summary in flight":
                deadline = time.monotonic() + 5
                while not upstream_calls(upstream, CRASH_KEY, "slow-summarizer") and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not upstream_calls(upstream, CRASH_KEY, "slow-summarizer"):
                    continue  # Microcompact alone made this speculation fit: no summary to kill around yet
                if upstream_calls(upstream, CRASH_KEY, "slow-summarizer")[-1][1].done:
                    continue  # a busy machine let it finish before the kill: wait for the next one
            crash = gws["crash"]
            crash.proc.send_signal(signal.SIGKILL)
            crash.proc.wait(10)
            LIVE.remove(crash)
            killed_at = k
            gws["crash"] = launch("crash", tmp_path / "crash", crash_cfg).wait_ready()
    finally:
        stop_all(gws.values())
    assert killed_at is not None, "the session never started a speculative summary"

    control_payloads = {r.body["user"]: r.raw for _, r in upstream_calls(upstream, CONTROL_KEY, "gpt-4o")}
    crash_payloads = {r.body["user"]: r.raw for _, r in upstream_calls(upstream, CRASH_KEY, "gpt-4o")}
    different = sorted((int(tag.rsplit(":", 1)[1]) for tag in control_payloads
                        if crash_payloads.get(tag) != control_payloads[tag]))
    assert not different, (f"killed after turn {killed_at} ({moment}): turns {different} were forwarded "
                           f"differently from the control")
    control_summaries = Counter(r.raw for _, r in upstream_calls(upstream, CONTROL_KEY, "slow-summarizer"))
    crash_summaries = Counter(r.raw for _, r in upstream_calls(upstream, CRASH_KEY, "slow-summarizer"))
    assert set(control_summaries.values()) == {1}
    if moment == "summary kept":
        assert crash_summaries == control_summaries, "a summary kept in the log was asked for again"
