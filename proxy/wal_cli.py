"""`ctxgate wal ...` and `ctxgate stats`: the session logs, read and repaired from a shell.

Every command prints lines a person can read, or JSON with `--json`. They work on the log
backend the config names (`wal.backend`: files or Redis) and next to a running gateway:
on files, writes hold the same per-file lock the gateway's appends do; on Redis, an append
is one script and an archive pass retries when an append came between.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from ctxgate.wal.backend import WalLog, WalUnavailable
from ctxgate.wal.mirror import DB_NAME, compression_stats, import_logs
from ctxgate.wal.paths import safe_name
from ctxgate.wal.reader import WalScan
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
    archive = command("archive", "move events before each log's latest checkpoint to the archive, prune old archives")
    archive.add_argument("--retention-days", type=float, default=None)
    stats = sub.add_parser("stats", help="compressions and tokens saved per tenant, day and level (SQLite mirror)")
    common(stats)
    stats.add_argument("--tenant", default=None)
    stats.add_argument("--since", default=None, help="first day, YYYY-MM-DD")
    stats.add_argument("--import", dest="import_files", action="store_true",
                       help="first copy events from the logs that the mirror does not have")
    stats.add_argument("--json", action="store_true")


def run(args: argparse.Namespace, config: Config) -> int:
    data_dir = Path(args.data_dir or config.ctxgate.data_dir)
    journal = Journal(data_dir, config.ctxgate.wal, state=config.ctxgate.state)
    name = "stats" if args.command == "stats" else f"wal {args.wal_command}"
    try:
        if args.command == "stats":
            return _stats(args, journal)
        handler = {"list": _list, "show": _show, "verify": _verify, "replay": _replay, "rollback": _rollback,
                   "archive": _archive}[args.wal_command]
        return handler(args, config, journal)
    except _Refused as e:
        print(f"ctxgate {name}: {e}", file=sys.stderr)
        return 2
    except WalUnavailable as e:
        print(f"ctxgate {name}: the log cannot be read: {e}", file=sys.stderr)
        return 2
    finally:
        journal.close()


class _Refused(Exception):
    pass


def _out(args: argparse.Namespace, data: Any, lines: list[str]) -> None:
    if args.json:
        sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write("".join(line + "\n" for line in lines))


def _find(log: WalLog, session: str, tenant: str | None) -> tuple[str, str]:
    """(tenant, session) as the backend lists them (files: their safe names)."""
    owners = [(i.tenant, i.session) for i in log.sessions(tenant)
              if session in (i.session, safe_name(i.session)) or safe_name(session) == i.session]
    if tenant is not None and not owners and log.history(tenant, session).scans[0].events:
        owners = [(tenant, session)]  # archives only: still shown and restorable
    if not owners:
        raise _Refused(f"no log of session {session}" + (f" for tenant {tenant}" if tenant else f" in {log.where}"))
    if len(owners) > 1:
        raise _Refused(f"session {session} exists for tenants {', '.join(t for t, _ in owners)}: say which with "
                       f"--tenant")
    return owners[0]


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


def _list(args: argparse.Namespace, config: Config, journal: Journal) -> int:
    log = journal.writer
    rows = [_summary(i.tenant, i.session, log.live(i.tenant, i.session)) for i in log.sessions(args.tenant)]
    lines = [f"{'TENANT':<16} {'SESSION':<32} {'EVENTS':>7} {'SEQ':>7} {'CKPTS':>5} {'BYTES':>10}  STATUS"]
    lines += [f"{r['tenant']:<16} {r['session']:<32} {r['events']:>7} {r['last_seq']:>7} {r['checkpoints']:>5} "
              f"{r['bytes']:>10}  {_status(r)}" for r in rows]
    lines.append(f"{len(rows)} session logs in {log.where}")
    _out(args, rows, lines)
    return 0


def _brief(event: dict[str, Any]) -> str:
    skip = {"seq", "type", "timestamp", "state", "prefix_hash"}
    fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in skip and v is not None)
    return f"{event['seq']:>6} {event.get('timestamp', ''):<24} {event['type']:<12} {fields}"


def _show(args: argparse.Namespace, config: Config, journal: Journal) -> int:
    tenant, session = _find(journal.writer, args.session, args.tenant)
    events = [e for scan in journal.writer.history(tenant, session).scans for e in scan.events]
    shown = events[-args.limit:] if args.limit else events
    data = [{k: v for k, v in e.items() if k != "state"} for e in shown]
    _out(args, data, [_brief(e) for e in shown] + [f"{len(shown)} of {len(events)} events of {tenant}/{session}"])
    return 0


def _verify(args: argparse.Namespace, config: Config, journal: Journal) -> int:
    log = journal.writer
    if args.session:
        targets = [_find(log, args.session, args.tenant)]
    else:
        targets = [(i.tenant, i.session) for i in log.sessions(args.tenant)]
    if args.repair:
        for tenant, session in targets:
            log.open(tenant, session)  # sets a torn last line aside, as the gateway does on first sight
    rows, lines, damaged = [], [], 0
    for tenant, session in targets:
        for scan in log.history(tenant, session).scans:
            row = _summary(tenant, session, scan)
            rows.append(row)
            damaged += len(row["damaged"])
            lines.append(f"{_status(row):<28} {scan.path}")
            lines += [f"    line {d['line']}: {d['reason']}" for d in row["damaged"]]
    torn = sum(1 for r in rows if r["torn_bytes"])
    lines.append(f"{len(rows)} files, {damaged} damaged lines, {torn} torn last lines"
                 + (" (the gateway sets them aside when it next opens the session; --repair does it now)"
                    if torn else ""))
    _out(args, {"files": rows, "damaged_lines": damaged, "torn_files": torn}, lines)
    return 1 if damaged else 0


def _replay(args: argparse.Namespace, config: Config, journal: Journal) -> int:
    tenant, session = _find(journal.writer, args.session, args.tenant)
    state = asyncio.run(journal.recover(tenant, session))
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


def _rollback(args: argparse.Namespace, config: Config, journal: Journal) -> int:
    tenant, session = _find(journal.writer, args.session, args.tenant)
    try:
        state = asyncio.run(journal.rollback(tenant, session, args.to_seq))
    except RollbackError as e:
        raise _Refused(str(e)) from None
    _out(args, {"tenant": tenant, "session": session, "rolled_back_to": args.to_seq, "seq": state.wal_seq},
         [f"session {tenant}/{session} rolled back to checkpoint {args.to_seq} (written as checkpoint "
          f"{state.wal_seq}); a gateway with in-memory state picks it up on the session's next turn, one with "
          f"Redis state needs POST /v1/ctx/sessions/{session}/rollback"])
    return 0


def _archive(args: argparse.Namespace, config: Config, journal: Journal) -> int:
    wal = config.ctxgate.wal
    retention_days = args.retention_days if args.retention_days is not None else wal.archive_retention_days
    moved = []
    for info in journal.writer.sessions(args.tenant):
        segment = journal.writer.archive(info.tenant, info.session)
        if segment is not None:
            moved.append({"tenant": info.tenant, "session": info.session, "segment": segment})
    removed = journal.writer.prune(retention_days * 86400.0, time.time())
    _out(args, {"archived": moved, "removed": removed},
         [f"archived {m['tenant']}/{m['session']} -> {m['segment']}" for m in moved]
         + [f"removed {p} (older than {retention_days:g} days)" for p in removed]
         + [f"{len(moved)} logs archived, {len(removed)} old archives removed"])
    return 0


def _stats(args: argparse.Namespace, journal: Journal) -> int:
    db = journal.paths.data_dir / DB_NAME
    imported = import_logs(db, journal.writer) if args.import_files else 0
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
