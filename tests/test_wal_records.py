"""A checkpoint writes only the compaction records its file does not hold yet and names the
others, so a compacting turn writes O(its new record), not every record again; every file
(live or archived) still reads back on its own, and recovery and rollback see whole records.

Driven on real files through the journal the gateway uses."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ctxgate.proxy.engine.journal import Journal
from ctxgate.proxy.engine.state import CompactionRecord, SessionState
from ctxgate.wal.config import WalConfig
from ctxgate.wal.paths import WalPaths
from ctxgate.wal.reader import scan_file
from ctxgate.wal.records import is_ref


def _record(n: int) -> CompactionRecord:
    return CompactionRecord(prefix_len=10 * (n + 1), prefix_hash=f"h{n}", levels=["autocompact"],
                            messages=[{"role": "user", "content": f"summary {n} " + "detail " * 4000}],
                            tokens_before=50_000, tokens_after=4_000, created_at=1000.0 + n, counted_by="o200k_base")


def _checkpoint_lines(path: Path) -> list[tuple[int, int]]:
    """(seq, bytes of its line) of every checkpoint in a file."""
    scan = scan_file(path)
    data = path.read_bytes()
    ends = scan.offsets[1:] + [len(data)]
    return [(e["seq"], end - start) for e, start, end in zip(scan.events, scan.offsets, ends)
            if e["type"] == "CHECKPOINT"]


def test_a_checkpoint_names_what_its_file_holds_and_recovery_reads_it_whole(tmp_path: Path) -> None:
    async def run() -> None:
        journal = Journal(tmp_path, WalConfig(archive_every=100))
        state = SessionState("t", "s", profile="professional")
        for n in range(4):
            state.add_record(_record(n))
            await journal.checkpoint(state, "compaction")
        live = WalPaths(tmp_path).live("t", "s")
        sizes = [size for _, size in _checkpoint_lines(live)]
        one_record = len(_record(0).messages[0]["content"])
        assert all(size < 2 * one_record for size in sizes), sizes  # each writes its new record only
        events = scan_file(live).checkpoints
        assert [sum(is_ref(r) for r in e["state"]["records"]) for e in events] == [0, 1, 2, 3]
        journal.close()
        recovered = await Journal(tmp_path, WalConfig()).recover("t", "s")
        assert recovered is not None and recovered.records == state.records
        assert recovered.wal_full_records == state.wal_full_records

    asyncio.run(run())


def test_every_file_reads_back_alone_after_an_archive_pass_and_rollback_sees_whole_records(tmp_path: Path) -> None:
    async def run() -> None:
        journal = Journal(tmp_path, WalConfig(archive_every=2), clock=time.time)
        state = SessionState("t", "s", profile="professional")
        for n in range(5):
            state.add_record(_record(n))
            await journal.checkpoint(state, "compaction")
        paths = WalPaths(tmp_path)
        archives = paths.archives("t", "s")
        assert archives, "the archive pass ran"
        for path in [*archives, paths.live("t", "s")]:
            first = scan_file(path).checkpoints[0]
            assert not any(is_ref(r) for r in first["state"]["records"]), path  # each file starts whole
        first_seq = scan_file(archives[0]).checkpoints[1]["seq"]  # holds two records, one of them named
        rolled = await journal.rollback("t", "s", first_seq)
        assert rolled.records == [_record(0), _record(1)]
        journal.close()
        recovered = await Journal(tmp_path, WalConfig()).recover("t", "s")
        assert recovered is not None and recovered.records == [_record(0), _record(1)]

    asyncio.run(run())
