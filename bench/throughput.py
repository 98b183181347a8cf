"""Requests per second through ctxgate and the LiteLLM proxy at a fixed concurrency.

The same number of workers for both: `ctxgate serve --workers N` (`forwarding: auto`,
`max_input_tokens` 1,000,000, nothing compacted; N > 1 needs `--state redis://...`, or
$CTXGATE_BENCH_STATE) and the LiteLLM proxy `--num_workers N`, in front of bench/upstream.py.
C clients in a closed loop (each sends its next request when the previous is answered,
one pooled aiohttp session) through the chat door, non-stream, for
`--seconds` after a one-second warm-up, per (scenario, concurrency, target). `direct` (the
upstream alone) is this harness's ceiling: the load generator, the upstream and the target
share the cores. turn-2K: each client its own session's steady next turn of a 2K-token
conversation (common.turn); conv-100K: every request a 100K-token conversation never seen
before. Latency is per request, under that load.

    .venv/bin/python bench/throughput.py [--concurrency 20,100] [--seconds 8] [--workers 1]
        [--state redis://127.0.0.1:6379/0] [--scenarios turn-2K,conv-100K] [--litellm-proxy PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import common
import doors
import processes

import aiohttp

DOOR = doors.CHAT
Row = tuple[str, int, str, dict[str, Any]]
"""(scenario, concurrency, target, what `drive` measured)."""


async def drive(load: doors.Target, scenario: str, base_msgs: list[doors.Message], concurrency: int,
                seconds: float, http: aiohttp.ClientSession, run: str) -> dict[str, Any]:
    """C clients each sending its next request as soon as the last is answered, for 1 s of
    warm-up and `seconds` more: replies and latencies in the measured window, every reply
    (`answered`) and the errors."""
    in_window: list[float] = []
    answered, errors = [0], []
    t0 = time.perf_counter()
    window = (t0 + 1.0, t0 + 1.0 + seconds)

    async def client(w: int) -> None:
        i = 0
        while time.perf_counter() < window[1]:
            if scenario.startswith("turn"):
                msgs, sid = common.turn(base_msgs, i), f"{run}-{w}-{i // common.TURNS_PER_SESSION}"
            else:
                msgs, sid = common.fresh(base_msgs, w * 1_000_000 + i), None
            started = time.perf_counter()
            try:
                error, _, _ = await load.post(http, DOOR, msgs, sid)
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

    await asyncio.gather(*(client(w) for w in range(concurrency)))
    return {"rps": len(in_window) / seconds, "n": len(in_window), "answered": answered[0],
            "p50": common.pct(in_window, 0.5), "p95": common.pct(in_window, 0.95), "errors": len(errors),
            "first_error": errors[0] if errors else ""}


async def main_async(args: argparse.Namespace) -> tuple[list[Row], doors.Target | str]:
    common.wait_for_quiet(max_wait_s=args.max_wait)
    counter = common.gpt4o_counter()
    sizes = {"turn-2K": 2_000, "conv-100K": 100_000}
    bases = {name: common.build_conversation(sizes[name], counter) for name in args.scenarios}
    rows = []
    with processes.Servers("ctxgate-throughput-") as servers:
        upstream = servers.upstream()
        gw = servers.ctxgate(processes.ctxgate_config(upstream.url, servers.workdir, state=args.state),
                             workers=args.workers)
        loads = [doors.Target("direct", upstream.url, processes.UPSTREAM_KEY),
                 doors.Target("ctxgate forwarding=auto", gw.url, processes.UPSTREAM_KEY, session_header=True)]
        proxy = servers.litellm_proxy(args.litellm_proxy, upstream.url, args.workers)
        common.progress(f"throughput: LiteLLM proxy: {processes.proxy_note(proxy)}")
        loads += [] if isinstance(proxy, str) else [proxy]
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=processes.CLIENT_KEEPALIVE_S)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
            for scenario in args.scenarios:
                for c in args.concurrency:
                    for load in loads:
                        run = f"tp-{os.urandom(4).hex()}"
                        r = await drive(load, scenario, bases[scenario], c, args.seconds, http, run)
                        rows.append((scenario, c, load.name, r))
                        common.progress(f"  {scenario:9s} c={c:<3d} {load.name:34s} {r['rps']:8.1f} req/s  "
                                        f"p50 {r['p50']:8.1f} ms  p95 {r['p95']:8.1f} ms  errors {r['errors']}"
                                        + (f" ({r['first_error'][:120]})" if r["errors"] else ""))
                        await asyncio.sleep(1.0)
    return rows, proxy


def write_results(args: argparse.Namespace, rows: list[Row], proxy: doors.Target | str) -> None:
    concurrency = " and ".join(str(c) for c in args.concurrency)
    lines = [common.section_header(f"Throughput: requests per second at concurrency {concurrency}"), "",
             common.about(__doc__) + f"\n\nWorkers: {args.workers}" + (f", `ctxgate.state` {args.state}"
                                                                       if args.state and args.workers > 1 else "")
             + f"; {args.seconds:g} s measured. LiteLLM proxy: {processes.proxy_note(proxy)}\n"]
    table_rows = []
    for scenario, c, name, r in rows:
        table_rows.append([scenario, c, name, f"{r['rps']:.1f}", r["n"], f"{r['p50']:.1f}", f"{r['p95']:.1f}",
                           r["errors"]])
    lines.append(common.table(["scenario", "concurrency", "target", "req/s", "replies", "p50 ms", "p95 ms",
                               "errors"], table_rows, "lrlrrrrr") + "\n")
    if not isinstance(proxy, str):
        by = {(s, c, n): r for s, c, n, r in rows}
        ratio_rows = []
        for scenario in args.scenarios:
            for c in args.concurrency:
                a = by.get((scenario, c, "ctxgate forwarding=auto"))
                b = next((r for (s, cc, n), r in by.items() if s == scenario and cc == c
                          and n.startswith("LiteLLM proxy")), None)
                if a and b and b["rps"] > 0:
                    ratio_rows.append([scenario, c, f"{a['rps'] / b['rps']:.2f}×"])
        lines.append("**ctxgate req/s ÷ LiteLLM proxy req/s** (issue 13's aim at concurrency 20: ≥ 2×):\n")
        lines.append(common.table(["scenario", "concurrency", "ratio"], ratio_rows, "lrr") + "\n")
    common.publish("throughput", "\n".join(lines), args.out)


def main() -> None:
    p = common.parser(__doc__, wait=600.0, proxy=True)
    p.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[20, 100])
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per (scenario, concurrency, target)")
    p.add_argument("--scenarios", type=lambda v: v.split(","), default=["turn-2K", "conv-100K"],
                   help="turn-2K, conv-100K")
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes, the same for both: `ctxgate serve --workers N`, LiteLLM proxy "
                        "--num_workers N")
    p.add_argument("--state", default=os.environ.get("CTXGATE_BENCH_STATE"),
                   help="ctxgate.state for ctxgate (a redis:// URL); needed when --workers > 1, since ctxgate "
                        "refuses several workers on its in-memory state (default $CTXGATE_BENCH_STATE)")
    args = p.parse_args()
    if args.workers < 1:
        p.error("--workers: give a number of processes, 1 or more (the same for both servers)")
    if args.workers > 1 and not (args.state or "").startswith("redis://"):
        p.error(f"--workers {args.workers}: ctxgate needs a shared state backend for more than one worker; "
                "give --state redis://HOST:PORT/DB (or set $CTXGATE_BENCH_STATE)")
    common.use_uvloop()
    write_results(args, *asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
