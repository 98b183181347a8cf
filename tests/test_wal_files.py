"""The WAL on real files: checksums, torn and damaged lines, recovery, rollback, archive
and retention with a controllable clock, the SQLite mirror, and the `ctxgate wal` CLI."""
from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from ctxgate.proxy.engine.journal import Journal, RollbackError
from ctxgate.proxy.engine.state import SessionState
from ctxgate.wal.archive import prune_archives
from ctxgate.wal.config import WalConfig
from ctxgate.wal.events import DamagedLine, decode_line, encode_line
from ctxgate.wal.mirror import DB_NAME, SqliteMirror, compression_stats, import_files
from ctxgate.wal.paths import WalPaths, safe_name
from ctxgate.wal.reader import recover, scan_file
from ctxgate.wal.writer import WalWriter
from wal_builders import checkpoint_of, wal_state
from servers import run_ctxgate

DAY = 86400.0


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_line_carries_a_checksum_of_its_own_bytes() -> None:
    line = encode_line({"seq": 1, "type": "USER_INPUT", "content_hash": "abc"})
    assert line.endswith(b"}\n") and b'"crc":"' in line
    assert decode_line(line) == {"seq": 1, "type": "USER_INPUT", "content_hash": "abc"}
    flipped = line.replace(b"abc", b"abd")
    with pytest.raises(DamagedLine, match="checksum mismatch"):
        decode_line(flipped)
    with pytest.raises(DamagedLine, match="no checksum"):
        decode_line(b'{"seq":1,"type":"USER_INPUT"}\n')


def test_ids_that_are_not_plain_names_are_hashed_before_they_become_paths(tmp_path: Path) -> None:
    paths = WalPaths(tmp_path)
    assert paths.live("acme", "s-1").relative_to(tmp_path).as_posix() == "wal/acme/wal_s-1.jsonl"
    hostile = paths.live("../../etc", "x/../../passwd")
    assert hostile.parent.parent == tmp_path / "wal" and ".." not in hostile.as_posix()
    assert safe_name("../x").startswith("h-")


def test_seq_increases_and_never_goes_below_what_the_caller_or_file_has(tmp_path: Path) -> None:
    writer = WalWriter(WalPaths(tmp_path))
    a = writer.append("t", "s", [{"type": "USER_INPUT"}, {"type": "TOOL_RESULT"}])
    assert [e["seq"] for e in a.events] == [1, 2]
    b = writer.append("t", "s", [{"type": "USER_INPUT"}], after_seq=10)
    assert b.last_seq == 11
    writer.close()
    again = WalWriter(WalPaths(tmp_path)).append("t", "s", [{"type": "RESPONSE"}], after_seq=0)
    assert again.last_seq == 12  # a fresh writer continues from the file, not from the caller's stale 0
    assert [e["seq"] for e in scan_file(WalPaths(tmp_path).live("t", "s")).events] == [1, 2, 11, 12]


def test_a_torn_last_line_is_set_aside_and_reported_never_fatal(tmp_path: Path) -> None:
    paths = WalPaths(tmp_path)
    writer = WalWriter(paths)
    writer.append("t", "s", [{"type": "USER_INPUT"}, {"type": "RESPONSE"}])
    writer.close()
    live = paths.live("t", "s")
    whole = encode_line({"seq": 3, "type": "USER_INPUT", "content_hash": "zz"})
    with open(live, "ab") as fh:
        fh.write(whole[:20])  # the crash came mid-write
    scan = scan_file(live)
    assert scan.torn == whole[:20] and not scan.damaged and scan.last_seq == 2

    torn: list[bytes] = []
    writer = WalWriter(paths, on_torn=lambda path, data: torn.append(data))
    assert writer.open("t", "s").torn == whole[:20]
    assert torn == [whole[:20]]
    assert live.with_name(live.name + ".torn").read_bytes() == whole[:20] + b"\n"
    assert writer.append("t", "s", [{"type": "USER_INPUT"}]).last_seq == 3
    after = scan_file(live)
    assert after.ok and [e["seq"] for e in after.events] == [1, 2, 3]


def test_a_damaged_line_is_reported_with_its_number_and_recovery_uses_the_checkpoint_before_it(tmp_path: Path) -> None:
    paths = WalPaths(tmp_path)
    writer = WalWriter(paths)
    first, second = wal_state(turns=1, tokens_after=100), wal_state(turns=2, tokens_after=200)
    writer.append("t1", "s1", [{"type": "USER_INPUT"}, checkpoint_of(first), {"type": "USER_INPUT"}])
    writer.append("t1", "s1", [checkpoint_of(second), {"type": "RESPONSE", "turn": 3}])
    writer.close()
    live = paths.live("t1", "s1")
    lines = live.read_bytes().splitlines(keepends=True)
    lines[3] = lines[3].replace(b'"tokens_after":200', b'"tokens_after":999')  # bit rot in the newest checkpoint
    live.write_bytes(b"".join(lines))

    scan = scan_file(live)
    assert [(d.line, d.reason) for d in scan.damaged] == [(4, "checksum mismatch")]
    found = recover([scan])
    assert found.checkpoint is not None and found.checkpoint["seq"] == 2
    assert [e["seq"] for e in found.events] == [3, 5]  # the damaged line skipped, the rest replayed
    state = asyncio.run(Journal(tmp_path, WalConfig()).recover("t1", "s1"))
    assert state is not None and state.records[0].tokens_after == 100 and state.turns == 3 and state.wal_seq == 5


def test_recovery_skips_a_seq_it_already_applied(tmp_path: Path) -> None:
    paths = WalPaths(tmp_path)
    live = paths.live("t", "s")
    live.parent.mkdir(parents=True)
    events = [{"seq": 1, "type": "USER_INPUT"}, {"seq": 2, "type": "RESPONSE"}, {"seq": 2, "type": "RESPONSE"},
              {"seq": 3, "type": "USER_INPUT"}]
    live.write_bytes(b"".join(encode_line(e) for e in events))
    scan = scan_file(live)
    assert [e["seq"] for e in scan.events] == [1, 2, 3]
    assert [d.line for d in scan.damaged] == [3] and "out of order" in scan.damaged[0].reason


def test_archive_after_n_checkpoints_keeps_the_live_file_small_and_recovery_exact(tmp_path: Path) -> None:
    clock = Clock()
    journal = Journal(tmp_path, WalConfig(archive_every=3), clock=clock)
    state = wal_state()

    async def run() -> None:
        for turn in range(12):
            state.turns = turn
            # A record is replaced, never changed in place (the engine's rule; a checkpoint names a
            # record its file already holds by prefix and creation time).
            state.records[0] = replace(state.records[0], tokens_after=100 + turn, created_at=2.0 + turn)
            await journal.checkpoint(state, "periodic")
            state.wal_seq = (await asyncio.to_thread(journal.writer.append, "t1", "s1",
                                                     [{"type": "RESPONSE", "turn": turn}], state.wal_seq)).last_seq

    asyncio.run(run())
    journal.close()
    paths = WalPaths(tmp_path)
    live = scan_file(paths.live("t1", "s1"))
    assert len(live.checkpoints) <= 3 and live.events[0]["type"] == "CHECKPOINT"
    segments = paths.archives("t1", "s1")
    assert len(segments) == 3  # at checkpoints 4, 7 and 10: every three
    archived = [e["seq"] for f in segments for e in scan_file(f).events]
    assert archived + [e["seq"] for e in live.events] == list(range(1, 25))  # nothing lost, nothing twice
    again = asyncio.run(Journal(tmp_path, WalConfig()).recover("t1", "s1"))
    assert again is not None and again.records[0].tokens_after == 111 and again.wal_seq == 24


def test_archives_past_their_retention_are_removed(tmp_path: Path) -> None:
    clock = Clock()
    paths = WalPaths(tmp_path)
    old = paths.archive_dir("t1") / "wal_s1.1-10.jsonl"
    new = paths.archive_dir("t1") / "wal_s1.11-20.jsonl"
    old.parent.mkdir(parents=True)
    for f, age in ((old, 8 * DAY), (new, 6 * DAY)):
        f.write_bytes(encode_line({"seq": 1, "type": "RESPONSE"}))
        os.utime(f, (clock.now - age, clock.now - age))
    assert prune_archives(paths.archive_root, 7 * DAY, clock.now) == [old]
    assert not old.exists() and new.exists()
    clock.now += 2 * DAY
    assert prune_archives(paths.archive_root, 7 * DAY, clock.now) == [new]


def test_rollback_restores_a_checkpoint_as_a_new_one_and_names_the_ones_there_are(tmp_path: Path) -> None:
    journal = Journal(tmp_path, WalConfig())

    async def run() -> SessionState:
        state = wal_state()
        for turn in (1, 2, 3):
            state.turns, state.records[0].tokens_after = turn, turn * 100
            await journal.checkpoint(state, "compaction")
        return await journal.rollback("t1", "s1", 1)

    rolled = asyncio.run(run())
    assert rolled.records[0].tokens_after == 100 and rolled.turns == 1 and rolled.wal_seq == 4
    with pytest.raises(RollbackError, match=r"checkpoints: 1, 2, 3, 4"):
        asyncio.run(journal.rollback("t1", "s1", 2 + 7))
    journal.close()
    recovered = asyncio.run(Journal(tmp_path, WalConfig()).recover("t1", "s1"))
    assert recovered is not None and recovered.records[0].tokens_after == 100 and recovered.wal_seq == 4
    last = scan_file(WalPaths(tmp_path).live("t1", "s1")).events[-1]
    assert last["reason"] == "rollback" and last["rolled_back_to"] == 1


def test_the_sqlite_mirror_counts_compressions_and_a_catch_up_import_adds_nothing_twice(tmp_path: Path) -> None:
    events = [{"seq": i, "type": "COMPRESSION", "timestamp": f"2026-12-0{1 + i % 2}T10:00:00.000Z",
               "level": "snip" if i % 3 else "autocompact", "input_tokens": 1000, "output_tokens": 400}
              for i in range(1, 7)]
    paths = WalPaths(tmp_path)
    live = paths.live("t1", "s1")
    live.parent.mkdir(parents=True)
    live.write_bytes(b"".join(encode_line(e) for e in events))
    mirror = SqliteMirror(tmp_path / DB_NAME)
    mirror.put("t1", "s1", events[:3])
    mirror.close()
    rows = compression_stats(tmp_path / DB_NAME)
    assert sum(r["compressions"] for r in rows) == 3
    assert import_files(tmp_path / DB_NAME, paths) == 3  # only the three the mirror missed
    assert import_files(tmp_path / DB_NAME, paths) == 0
    rows = compression_stats(tmp_path / DB_NAME, tenant="t1")
    assert {(r["day"], r["level"]): (r["compressions"], r["tokens_saved"]) for r in rows} == {
        ("2026-12-01", "autocompact"): (1, 600), ("2026-12-01", "snip"): (2, 1200),
        ("2026-12-02", "autocompact"): (1, 600), ("2026-12-02", "snip"): (2, 1200)}
    assert compression_stats(tmp_path / DB_NAME, tenant="nobody") == []


def _cli(tmp_path: Path, *args: str) -> tuple[int, str]:
    done = run_ctxgate([*args, "--data-dir", str(tmp_path / "data")], cwd=tmp_path)
    return done.returncode, done.stdout if "--json" in args else done.stdout + done.stderr


def _fill(data: Path) -> None:
    journal = Journal(data, WalConfig())

    async def run() -> None:
        for session in ("s1", "s2"):
            state = wal_state("t1", session)
            state.working = {"pending_tasks": ["fix the parser"], "current_files": [{"path": "src/app.py"}]}
            for turn in (1, 2):
                state.turns = turn
                await journal.checkpoint(state, "compaction")
                state.wal_seq = journal.writer.append("t1", session, [{"type": "USER_INPUT", "turn": turn}],
                                                      state.wal_seq).last_seq

    asyncio.run(run())
    journal.close()


def test_cli_list_show_verify_replay_rollback_archive(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _fill(data)
    code, out = _cli(tmp_path, "wal", "list", "--json")
    rows = json.loads(out)
    assert code == 0 and {(r["session"], r["events"], r["checkpoints"]) for r in rows} == {("s1", 4, 2), ("s2", 4, 2)}
    code, out = _cli(tmp_path, "wal", "show", "s1")
    assert code == 0 and "CHECKPOINT" in out and "4 of 4 events of t1/s1" in out
    code, out = _cli(tmp_path, "wal", "replay", "s1")
    assert code == 0 and "seq 4, 2 turns" in out and "pending task: fix the parser" in out
    assert "current file: src/app.py" in out
    code, out = _cli(tmp_path, "wal", "verify")
    assert code == 0 and "0 damaged lines" in out

    code, out = _cli(tmp_path, "wal", "rollback", "s1", "--to", "1")
    assert code == 0 and "rolled back to checkpoint 1" in out
    code, out = _cli(tmp_path, "wal", "replay", "s1", "--json")
    assert json.loads(out)["turns"] == 1
    code, out = _cli(tmp_path, "wal", "rollback", "s1", "--to", "2")
    assert code == 2 and "no checkpoint at seq 2" in out
    code, out = _cli(tmp_path, "wal", "show", "nope")
    assert code == 2 and "no log of session nope" in out

    code, out = _cli(tmp_path, "wal", "archive", "--json")
    report = json.loads(out)
    assert code == 0 and len(report["archived"]) == 2
    assert scan_file(WalPaths(data).live("t1", "s2")).events[0]["type"] == "CHECKPOINT"
    code, out = _cli(tmp_path, "wal", "replay", "s2", "--json")
    assert code == 0 and json.loads(out)["wal_seq"] == 4  # the archived history still counts


def test_cli_verify_exits_1_on_damage_and_names_the_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _fill(data)
    live = WalPaths(data).live("t1", "s2")
    lines = live.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1][:10] + b"X" + lines[1][11:]
    live.write_bytes(b"".join(lines))
    code, out = _cli(tmp_path, "wal", "verify")
    assert code == 1 and "line 2: " in out and "DAMAGED (1 lines)" in out
    code, out = _cli(tmp_path, "wal", "verify", "s1")
    assert code == 0


def test_cli_verify_reports_a_torn_tail_and_repair_sets_it_aside(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _fill(data)
    live = WalPaths(data).live("t1", "s1")
    with open(live, "ab") as fh:
        fh.write(b'{"seq":5,"type":"USER')
    code, out = _cli(tmp_path, "wal", "verify", "--json")
    assert code == 0 and json.loads(out)["torn_files"] == 1
    code, out = _cli(tmp_path, "wal", "verify", "--repair", "--json")
    assert code == 0 and json.loads(out)["torn_files"] == 0
    assert live.with_name(live.name + ".torn").exists()


def test_cli_stats_over_the_mirror(tmp_path: Path) -> None:
    data = tmp_path / "data"
    paths = WalPaths(data)
    live = paths.live("t1", "s1")
    live.parent.mkdir(parents=True)
    live.write_bytes(encode_line({"seq": 1, "type": "COMPRESSION", "timestamp": "2026-12-03T10:00:00.000Z",
                                  "level": "microcompact", "input_tokens": 5000, "output_tokens": 1000}))
    code, out = _cli(tmp_path, "stats")
    assert code == 2 and "no SQLite mirror" in out
    code, out = _cli(tmp_path, "stats", "--import", "--json")
    assert code == 0 and json.loads(out) == [{"tenant": "t1", "day": "2026-12-03", "level": "microcompact",
                                              "compressions": 1, "tokens_saved": 4000}]
