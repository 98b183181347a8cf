"""Garbage-collection pauses of a gateway over steady turns, per collector policy.

For each policy, a fresh process runs the gateway in-process (Gateway.build and create_app on a
loopback port, as `ctxgate serve` builds them, then proxy/gc_policy.py's `settle` with
`CTXGATE_GC` set to the policy: `python` is the interpreter's own, `server` what serve does) in
front of bench/upstream.py, and one client in the same event loop sends steady chat turns of
100K-token sessions (common.turn: ten turns a session, each resending the last; with
`--new-every N`, every Nth request a new 100K conversation instead; the bodies built before the
first is sent). A `gc.callbacks` timer records every collection after the
warm-up: how many per generation and how long each held the process (p50 / p99 / max), the
tracked objects the collector walks at the start and at the end, the time of one full
`gc.collect()` at the end, and each request's time as the client saw it.

    .venv/bin/python bench/gc_pauses.py [--turns 1000] [--size 100K] [--new-every 0] [--policies python,server]
        [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first, puts tests/ on sys.path
import doors
import processes

WARMUP = 20


class Pauses:
    """Each collection's generation and milliseconds, from `gc.callbacks`."""

    def __init__(self) -> None:
        self.by_generation: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.by_generation[info["generation"]].append((time.perf_counter() - self._started) * 1000)


async def measure(turns: int, size: int, new_every: int) -> dict[str, Any]:
    """One policy (`CTXGATE_GC` of this process): the figures of `turns` requests."""
    import yaml
    from aiohttp import ClientSession, web

    from ctxgate.proxy import gc_policy
    from ctxgate.proxy.app import create_app
    from ctxgate.proxy.config import load_config
    from ctxgate.proxy.gateway import Gateway

    base = common.build_conversation(size, common.gpt4o_counter())
    with processes.Servers("ctxgate-gc-") as servers:
        upstream = servers.upstream()
        path = servers.workdir / "ctxgate.yaml"
        path.write_text(yaml.safe_dump(processes.ctxgate_config(upstream.url, servers.workdir)))
        gw = Gateway.build(load_config(str(path)), str(servers.workdir / "data"))
        runner = web.AppRunner(create_app(gw), access_log=None)
        await runner.setup()
        port = processes.free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        gc_policy.settle()
        tracked_start, frozen = len(gc.get_objects()), gc.get_freeze_count()
        bodies = [doors.CHAT.payload(common.fresh(base, i) if new_every and i % new_every == 0 else
                                     common.turn(base, i)) for i in range(WARMUP + turns)]
        pauses, ms = Pauses(), []
        async with ClientSession() as http:
            for i, body in enumerate(bodies):
                if i == WARMUP:
                    gc.callbacks.append(pauses)
                error, took, _ = await doors.CHAT.post(http, f"http://127.0.0.1:{port}", [], processes.UPSTREAM_KEY,
                                                       f"gc-{i // common.TURNS_PER_SESSION}", body)
                if error:
                    raise RuntimeError(error)
                if i >= WARMUP:
                    ms.append(took)
        gc.callbacks.remove(pauses)
        tracked_end = len(gc.get_objects())
        started = time.perf_counter()
        gc.collect()
        full_ms = (time.perf_counter() - started) * 1000
        await runner.cleanup()
    return {"pauses": pauses.by_generation, "ms": ms, "tracked_start": tracked_start, "tracked_end": tracked_end,
            "frozen": frozen, "full_ms": full_ms}


def child(policy: str, turns: int, size: int, new_every: int) -> dict[str, Any]:
    """`measure` in a fresh interpreter with `CTXGATE_GC=policy`."""
    r = subprocess.run([sys.executable, __file__, "--child", "--turns", str(turns), "--size", str(size),
                        "--new-every", str(new_every)],
                       env={**os.environ, "CTXGATE_GC": policy}, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"policy {policy} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def figures(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{common.pct(values, 0.5):.2f} / {common.pct(values, 0.99):.2f} / {max(values):.2f}"


def report(results: dict[str, dict[str, Any]], turns: int, size: int, new_every: int) -> str:
    rows = []
    for policy, r in results.items():
        pauses = {int(g): v for g, v in r["pauses"].items()}
        rows.append([policy, f"{r['frozen']:,}", f"{r['tracked_start']:,} → {r['tracked_end']:,}",
                     *(f"{len(pauses[g])}" for g in (0, 1, 2)), *(figures(pauses[g]) for g in (0, 1, 2)),
                     f"{sum(sum(v) for v in pauses.values()):.0f}", f"{r['full_ms']:.1f}", figures(r["ms"])])
    label = f"{size // 1000}K" if size % 1000 == 0 else str(size)
    return "\n".join([
        common.section_header("Garbage-collection pauses over steady turns, per collector policy"), "",
        common.about(__doc__), "",
        f"{turns} measured chat requests after {WARMUP} warm-up: steady turns of {label}-token sessions"
        + (f", every {new_every}th a new {label}-token conversation" if new_every else "")
        + "; one policy per process, one after the other.", "",
        common.table(["CTXGATE_GC", "frozen objects", "tracked objects walked: start → end",
                      "gen0 collections", "gen1", "gen2", "gen0 pause ms p50 / p99 / max", "gen1 pause ms",
                      "gen2 pause ms", "all pauses ms", "one full gc.collect() at the end ms",
                      "request ms p50 / p99 / max"], rows, "lrrrrrrrrrrr"), ""])


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--turns", type=int, default=1000, help="measured steady turns per policy")
    p.add_argument("--size", type=lambda v: int(float(v[:-1]) * 1000) if v.upper().endswith("K") else int(v),
                   default=100_000, help="session size in tokens (1K = 1,000)")
    p.add_argument("--new-every", type=int, default=0, help="every Nth request a new conversation (0: none)")
    p.add_argument("--policies", default="python,server", help="comma-separated CTXGATE_GC values, one process each")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        common.use_uvloop()
        print(json.dumps(asyncio.run(measure(args.turns, args.size, args.new_every))))
        return
    results = {}
    for policy in args.policies.split(","):
        common.progress(f"gc_pauses: CTXGATE_GC={policy}, {args.turns} turns")
        results[policy] = child(policy, args.turns, args.size, args.new_every)
    key = "gc-pauses" + (f"-new-every-{args.new_every}" if args.new_every else "")
    common.publish(key, report(results, args.turns, args.size, args.new_every), args.out)


if __name__ == "__main__":
    main()
