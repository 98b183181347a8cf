"""`ctxgate wal ...` and `ctxgate stats`: the session logs, read and repaired from a shell.

Every command prints lines a person can read, or JSON with `--json`. They work next to a
running gateway: writes hold the same per-file lock the gateway's appends do.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from ..wal.archive import archive_segment, prune_archives
from ..wal.mirror import DB_NAME, compression_stats, import_files
from ..wal.paths import WalPaths, safe_name
from ..wal.reader import WalScan, scan_file
from ..wal.writer import WalWriter, flocked
from .config import Config
from .engine.journal import Journal, RollbackError


def add_commands(sub: Any, common: Any) -> None:
    wal = sub.add_parser("wal", help="inspect, verify, replay, roll back and archive session logs")
    wal_sub = wal.add_subparsers(dest="wal_command", required=True)

    def command(name: str, help: str, session: str | None = None) -> argparse.ArgumentParser:
        p = wal_sub.add_parser(name, help=help)
        common(p)
        p.add_argument("--tenant", default=None, help="the session's tenant (default: the only one that has it)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        if session == "required":
            p.add_argument("session")
        elif session == "optional":
            p.add_argument("session", nargs="?")
        return p

    command("list", "every session log: events, last seq, checkpoints, damage")
    show = command("show", "the events of one session", "required")
    show.add_argument("--limit", type=int, default=50, help="the last N events (0: all)")
    verify = command("verify", "check every line's checksum and seq order; exit 1 on damage", "optional")
    verify.add_argument("--repair", action="store_true", help="set torn last lines aside (as the gateway does)")
    command("replay", "rebuild a session's state from its log, as a restart would", "required")
    rollback = command("rollback", "restore a session to one of its checkpoints", "required")
    rollback.add_argument("--to", type=int, required=True, dest="to_seq", help="the checkpoint's seq")
    archive = command("archive", "move events before each log's latest checkpoint to wal_archive/, prune old archives")
    archive.add_argument("--retention-days", type=float, default=None)
    stats = sub.add_parser("stats", help="compressions and tokens saved per tenant, day and level (SQLite mirror)")
    common(stats)
    stats.add_argument("--tenant", default=None)
    stats.add_argument("--since", default=None, help="first day, YYYY-MM-DD")
    stats.add_argument("--import", dest="import_files", action="store_true",
                       help="first copy events from the JSONL logs that the mirror does not have")
    stats.add_argument("--json", action="store_true")


def run(args: argparse.Namespace, config: Config) -> int:
    data_dir = Path(args.data_dir or config.ctxgate.data_dir)
    paths = WalPaths(data_dir)
    if args.command == "stats":
        return _stats(args, paths)
    handler = {"list": _list, "show": _show, "verify": _verify, "replay": _replay, "rollback": _rollback,
               "archive": _archive}[args.wal_command]
    try:
        return handler(args, config, paths)
    except _Refused as e:
        print(f"ctxgate wal {args.wal_command}: {e}", file=sys.stderr)
        return 2


class _Refused(Exception):
    pass


def _out(args: argparse.Namespace, data: Any, lines: list[str]) -> None:
    if args.json:
        sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write("".join(line + "\n" for line in lines))


def _find(paths: WalPaths, session: str, tenant: str | None) -> tuple[str, str]:
    if tenant is not None:
        if not paths.live(tenant, session).exists() and not paths.archives(tenant, session):
            raise _Refused(f"no log of session {session} for tenant {tenant}")
        return safe_name(tenant), safe_name(session)
    owners = [t for t, s, _ in paths.sessions() if s == safe_name(session)]
    if not owners:
        raise _Refused(f"no log of session {session} under {paths.live_root}")
    if len(owners) > 1:
        raise _Refused(f"session {session} exists for tenants {', '.join(owners)}: say which with --tenant")
    return owners[0], safe_name(session)


def _summary(tenant: str, session: str, scan: WalScan) -> dict[str, Any]:
    last = scan.events[-1] if scan.events else {}
    return {"tenant": tenant, "session": session, "file": str(scan.path), "events": len(scan.events),
            "last_seq": scan.last_seq, "checkpoints": len(scan.checkpoints), "bytes": scan.good_length + len(scan.torn),
            "last_event_at": last.get("timestamp"), "torn_bytes": len(scan.torn),
            "damaged": [{"line": d.line, "reason": d.reason} for d in scan.damaged]}


def _status(s: dict[str, Any]) -> str:
    if s["damaged"]:
        return f"DAMAGED ({len(s['damaged'])} lines)"
    return f"torn last line ({s['torn_bytes']} bytes)" if s["torn_bytes"] else "ok"


def _list(args: argparse.Namespace, config: Config, paths: WalPaths) -> int:
    rows = [_summary(t, s, scan_file(f)) for t, s, f in paths.sessions(args.tenant)]
    lines = [f"{'TENANT':<16} {'SESSION':<32} {'EVENTS':>7} {'SEQ':>7} {'CKPTS':>5} {'BYTES':>10}  STATUS"]
    lines += [f"{r['tenant']:<16} {r['session']:<32} {r['events']:>7} {r['last_seq']:>7} {r['checkpoints']:>5} "
              f"{r['bytes']:>10}  {_status(r)}" for r in rows]
    lines.append(f"{len(rows)} session logs under {paths.live_root}")
    _out(args, rows, lines)
    return 0


def _brief(event: dict[str, Any]) -> str:
    skip = {"seq", "type", "timestamp", "state", "prefix_hash"}
    fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in skip and v is not None)
    return f"{event['seq']:>6} {event.get('timestamp', ''):<24} {event['type']:<12} {fields}"


def _show(args: argparse.Namespace, config: Config, paths: WalPaths) -> int:
    tenant, session = _find(paths, args.session, args.tenant)
    files = [*paths.archives(tenant, session), paths.live(tenant, session)]
    events = [e for f in files for e in scan_file(f).events]
    shown = events[-args.limit:] if args.limit else events
    data = [{k: v for k, v in e.items() if k != "state"} for e in shown]
    _out(args, data, [_brief(e) for e in shown] + [f"{len(shown)} of {len(events)} events of {tenant}/{session}"])
    return 0


def _verify(args: argparse.Namespace, config: Config, paths: WalPaths) -> int:
    if args.session:
        tenant, session = _find(paths, args.session, args.tenant)
        targets = [(tenant, session, paths.live(tenant, session))]
    else:
        targets = paths.sessions(args.tenant)
    if args.repair:
        writer = WalWriter(paths)
        for tenant, session, _ in targets:
            writer.open(tenant, session)  # sets a torn last line aside, as the gateway does on first sight
        writer.close()
    rows, lines, damaged = [], [], 0
    for tenant, session, live in targets:
        for f in [*paths.archives(tenant, session), live]:
            row = _summary(tenant, session, scan_file(f))
            rows.append(row)
            damaged += len(row["damaged"])
            lines.append(f"{_status(row):<28} {f}")
            lines += [f"    line {d['line']}: {d['reason']}" for d in row["damaged"]]
    torn = sum(1 for r in rows if r["torn_bytes"])
    lines.append(f"{len(rows)} files, {damaged} damaged lines, {torn} torn last lines"
                 + (" (the gateway sets them aside when it next opens the session; --repair does it now)"
                    if torn else ""))
    _out(args, {"files": rows, "damaged_lines": damaged, "torn_files": torn}, lines)
    return 1 if damaged else 0


def _replay(args: argparse.Namespace, config: Config, paths: WalPaths) -> int:
    tenant, session = _find(paths, args.session, args.tenant)
    journal = Journal(paths.data_dir, config.ctxgate.wal)
    try:
        state = asyncio.run(journal.recover(tenant, session))
    finally:
        journal.close()
    if state is None:
        raise _Refused(f"the log of {tenant}/{session} has no events")
    data = {"tenant": tenant, "session": session, "wal_seq": state.wal_seq, "turns": state.turns,
            "records": [{"prefix_len": r.prefix_len, "levels": r.levels, "tokens_before": r.tokens_before,
                         "tokens_after": r.tokens_after} for r in state.records],
            "has_attempted_reactive_compact": state.has_attempted_reactive_compact,
            "pending_tasks": state.working.get("pending_tasks", []),
            "current_files": [f.get("path") for f in state.working.get("current_files", [])]}
    lines = [f"session {tenant}/{session}: seq {state.wal_seq}, {state.turns} turns, {len(state.records)} "
             f"compaction records, loop guard {'set' if state.has_attempted_reactive_compact else 'clear'}"]
    lines += [f"  record over {r['prefix_len']} messages: {','.join(r['levels'])} "
              f"{r['tokens_before']} -> {r['tokens_after']} tokens" for r in data["records"]]
    lines += [f"  pending task: {t}" for t in data["pending_tasks"]]
    lines += [f"  current file: {p}" for p in data["current_files"]]
    _out(args, data, lines)
    return 0


def _rollback(args: argparse.Namespace, config: Config, paths: WalPaths) -> int:
    tenant, session = _find(paths, args.session, args.tenant)
    journal = Journal(paths.data_dir, config.ctxgate.wal)
    try:
        state = asyncio.run(journal.rollback(tenant, session, args.to_seq))
    except RollbackError as e:
        raise _Refused(str(e)) from None
    finally:
        journal.close()
    _out(args, {"tenant": tenant, "session": session, "rolled_back_to": args.to_seq, "seq": state.wal_seq},
         [f"session {tenant}/{session} rolled back to checkpoint {args.to_seq} (written as checkpoint "
          f"{state.wal_seq}); a gateway with in-memory state picks it up on the session's next turn, one with "
          f"Redis state needs POST /v1/ctx/sessions/{session}/rollback"])
    return 0


def _archive(args: argparse.Namespace, config: Config, paths: WalPaths) -> int:
    wal = config.ctxgate.wal
    retention_days = args.retention_days if args.retention_days is not None else wal.archive_retention_days
    moved = []
    for tenant, session, live in paths.sessions(args.tenant):
        with open(live, "ab") as fh, flocked(fh):
            at = _latest_checkpoint_offset(scan_file(live))
            segment = archive_segment(live, paths.archive_dir(tenant), at) if at else None
        if segment is not None:
            moved.append({"tenant": tenant, "session": session, "segment": str(segment)})
    removed = prune_archives(paths.archive_root, retention_days * 86400.0, time.time())
    _out(args, {"archived": moved, "removed": [str(p) for p in removed]},
         [f"archived {m['tenant']}/{m['session']} -> {m['segment']}" for m in moved]
         + [f"removed {p} (older than {retention_days:g} days)" for p in removed]
         + [f"{len(moved)} logs archived, {len(removed)} old archives removed"])
    return 0


def _latest_checkpoint_offset(scan: WalScan) -> int:
    """Where the last checkpoint line starts (0: none, or it is the first line already)."""
    for event, offset in zip(reversed(scan.events), reversed(scan.offsets)):
        if event["type"] == "CHECKPOINT" and isinstance(event.get("state"), dict):
            return offset
    return 0


def _stats(args: argparse.Namespace, paths: WalPaths) -> int:
    db = paths.data_dir / DB_NAME
    imported = import_files(db, paths) if args.import_files else 0
    if not db.exists():
        print(f"ctxgate stats: no SQLite mirror at {db} (the enterprise profile or wal.sqlite: true writes it; "
              f"--import builds it from the logs)", file=sys.stderr)
        return 2
    rows = compression_stats(db, args.tenant, args.since)
    lines = [f"{'TENANT':<16} {'DAY':<10} {'LEVEL':<13} {'COMPRESSIONS':>12} {'TOKENS SAVED':>13}"]
    lines += [f"{r['tenant']:<16} {r['day']:<10} {str(r['level']):<13} {r['compressions']:>12} {r['tokens_saved']:>13}"
              for r in rows]
    if imported:
        lines.append(f"({imported} events imported from the logs first)")
    _out(args, rows, lines)
    return 0
