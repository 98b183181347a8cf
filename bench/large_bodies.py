"""Whether huge requests stall everyone else: `/healthz` latency, probed every 10 ms, while
`--large` single-message requests of `--mb` MB go at once to a model with an 8,000-token limit
(each refused after it is parsed, hashed and counted), against the probe alone (issue 14:
three 36.6 MB requests, `/healthz` under 50 ms).

    .venv/bin/python bench/large_bodies.py [--mb 36.6] [--large 3] [--rounds 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import orjson

import common  # sets LITELLM_LOCAL_MODEL_COST_MAP first
import processes


async def probe(http: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        async with http.get(url + "/healthz") as r:
            await r.read()
        out.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(0.01)


async def run(url: str, args: argparse.Namespace) -> tuple[list[float], list[float], list[int], list[float], float]:
    """/healthz ms idle and under load, the large requests' statuses and ms, a body's MB."""
    text = "word " * int(args.mb * 1024 * 1024 / 5)
    body = orjson.dumps({"model": "small", "messages": [{"role": "user", "content": text}]})
    baseline: list[float] = []
    loaded: list[float] = []
    statuses: list[int] = []
    large_ms: list[float] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as probe_http, \
            aiohttp.ClientSession(timeout=timeout) as http:
        stop = asyncio.Event()
        task = asyncio.create_task(probe(probe_http, url, stop, baseline))
        await asyncio.sleep(2.0)
        stop.set()
        await task

        async def large() -> None:
            started = time.perf_counter()
            async with http.post(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {processes.UPSTREAM_KEY}"}) as r:
                await r.read()
                statuses.append(r.status)
            large_ms.append((time.perf_counter() - started) * 1000)

        for _ in range(args.rounds):
            stop = asyncio.Event()
            task = asyncio.create_task(probe(probe_http, url, stop, loaded))
            await asyncio.gather(*(large() for _ in range(args.large)))
            stop.set()
            await task
    return baseline, loaded, statuses, large_ms, len(body) / 1024 / 1024


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--mb", type=float, default=36.6, help="size of each large request body, MB")
    parser.add_argument("--large", type=int, default=3, help="large requests sent at once")
    parser.add_argument("--rounds", type=int, default=3, help="how many times")
    args = parser.parse_args()
    with processes.Servers("ctxgate-large-") as servers:
        upstream = servers.upstream().url
        server = servers.ctxgate({
            "model_list": [{"model_name": "small", "model_info": {"max_input_tokens": 8000}, "litellm_params": {
                "model": "openai/gpt-4o", "api_base": f"{upstream}/v1", "api_key": processes.UPSTREAM_KEY}}],
            "ctxgate": {"data_dir": str(servers.workdir / "data"), "max_body_bytes": 64 * 1024 * 1024}})
        common.progress(f"large bodies: {args.large} × {args.mb} MB at once, {args.rounds} rounds")
        base, loaded, statuses, large_ms, body_mb = asyncio.run(run(server.url, args))
    rows = [[name, len(xs), f"{common.pct(xs, 0.5):.2f}", f"{common.pct(xs, 0.95):.2f}", f"{max(xs):.2f}"]
            for name, xs in (("idle", base), (f"{args.large} large requests in flight", loaded))]
    text = common.section_header("Large bodies: /healthz while huge requests are processed")
    text += (f"\n{args.large} requests of {body_mb:.1f} MB (one user message) sent at once, {args.rounds} "
             "rounds, to a model whose limit is 8,000 tokens; a probe asks `/healthz` every 10 ms on its own "
             f"connection. Large requests answered: statuses {sorted(set(statuses))} (CONTEXT_EXHAUSTED is a 400), "
             f"each in {common.pct(large_ms, 0.5):.0f} ms p50 ({max(large_ms):.0f} ms max).\n\n")
    text += common.table(["/healthz", "probes", "p50 ms", "p95 ms", "max ms"], rows) + "\n"
    common.publish("large-bodies", text, args.out)


if __name__ == "__main__":
    main()
