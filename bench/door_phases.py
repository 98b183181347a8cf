"""Where a door's own time goes, door beside door, in one process.

The gateway runs in this process (its app on an aiohttp site, the start's objects frozen as
`ctxgate serve` freezes them), bench/upstream.py in another; this process sends each door's
body (bench/doors.py) for the same conversation, the doors in a shuffled order each
iteration, one request at a time: `turn` the steady turns of bench/common.py's sessions (ten
turns each), `conv` a conversation never seen. Per door, p50 of: `X-Ctx-Overhead-Ms`, the
wall time to the reply's last byte, and three phases of the request, timed by wrapping the
turn engine: `door` (the door's own reading, to `TurnEngine.prepare`), `prepare`, and
`forward` less the upstream's time (the wire's building of the upstream body and rendering
of its reply). `--profile DIR` also writes a cProfile of each door's requests there
(`DIR/<door>.prof`, a session's first turn left out of a `turn` run's; compare with pstats).

    .venv/bin/python bench/door_phases.py [--size 1K] [--kind turn] [--iterations 500] [--doors chat,gemini]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first
import doors
import processes
from overhead import parse_size

import aiohttp
from aiohttp import web

from ctxgate.proxy.app import create_app
from ctxgate.proxy.config import Config
from ctxgate.proxy.engine import turn as turn_module
from ctxgate.proxy.gateway import Gateway

WARMUP = 20
Phases = dict[str, dict[str, list[float]]]


def timed(phases: Phases, door: list[str]) -> None:
    """`TurnEngine.prepare` and `forward` wrapped: each request's phases, under its door's name."""
    engine = turn_module.TurnEngine
    prepare, forward = engine.prepare, engine.forward

    async def timed_prepare(self: Any, caller: Any, route: Any, session_id: str, request: Any, wire: Any,
                            headers: dict[str, str], started: float) -> Any:
        at = time.perf_counter()
        phases[door[0]]["door"].append(at - started)
        try:
            return await prepare(self, caller, route, session_id, request, wire, headers, started)
        finally:
            phases[door[0]]["prepare"].append(time.perf_counter() - at)

    async def timed_forward(self: Any, prepared: Any, wire: Any, stream: bool) -> Any:
        at = time.perf_counter()
        reply = await forward(self, prepared, wire, stream)
        phases[door[0]]["forward less upstream"].append(time.perf_counter() - at - reply.upstream_ms / 1000)
        return reply

    engine.prepare, engine.forward = timed_prepare, timed_forward  # type: ignore[method-assign]


async def run(args: argparse.Namespace) -> Phases:
    names = args.doors.split(",")
    phases: Phases = defaultdict(lambda: defaultdict(list))
    current = [""]
    timed(phases, current)
    profiles = {name: cProfile.Profile() for name in names} if args.profile else {}
    work = Path(tempfile.mkdtemp(prefix="door-phases-"))
    with processes.Servers("door-phases") as servers:
        upstream = servers.upstream()
        gw = Gateway.build(Config.model_validate(processes.ctxgate_config(upstream.url, work)), str(work / "data"))
        runner = web.AppRunner(create_app(gw), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        gc.collect()
        gc.freeze()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        conversation = common.build_conversation(args.size, common.gpt4o_counter())
        async with aiohttp.ClientSession() as http:
            for i in range(WARMUP + args.iterations):
                for name in random.sample(names, len(names)):
                    door = doors.DOORS[name]
                    messages = common.turn(conversation, i) if args.kind == "turn" \
                        else common.fresh(conversation, f"{i}:{name}")
                    session = f"s{i // common.TURNS_PER_SESSION}-{name}" if args.kind == "turn" else None
                    body = door.payload(messages)
                    current[0] = name if i >= WARMUP else "warmup"
                    # A session's first turn is a new conversation: a turn's profile holds steady turns only.
                    steady = args.kind == "conv" or i % common.TURNS_PER_SESSION
                    profile = profiles.get(name) if i >= WARMUP and steady else None
                    if profile is not None:
                        profile.enable()
                    error, ms, headers = await door.post(http, base, messages, processes.UPSTREAM_KEY, session, body)
                    if profile is not None:
                        profile.disable()
                    if error:
                        raise SystemExit(f"{name}: {error}")
                    if i >= WARMUP:
                        phases[name]["X-Ctx-Overhead-Ms"].append(float(headers["X-Ctx-Overhead-Ms"]) / 1000)
                        phases[name]["wall"].append(ms / 1000)
        await runner.cleanup()
    for name, profile in profiles.items():
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(str(Path(args.profile) / f"{name}.prof"))
    phases.pop("warmup", None)
    return phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=1000)
    p.add_argument("--kind", choices=("turn", "conv"), default="turn")
    p.add_argument("--iterations", type=int, default=500)
    p.add_argument("--doors", default="chat,gemini")
    p.add_argument("--profile", default=None, help="a folder: a cProfile of each door's requests")
    args = p.parse_args()
    phases = asyncio.run(run(args))
    kinds = list(dict.fromkeys(k for by_kind in phases.values() for k in by_kind))
    rows = [[name, *(f"{statistics.median(phases[name][k]) * 1e3:.3f}" for k in kinds)] for name in phases]
    print(f"{args.kind}-{args.size // 1000}K, {args.iterations} iterations, p50 ms; load {common.load_avg()}")
    print(common.table(["door", *kinds], rows))


if __name__ == "__main__":
    main()
