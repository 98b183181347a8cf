"""Reading a log back: every line checked, damage reported with its line number.

Recovery (docs/wal.md) is the latest intact CHECKPOINT, then the events after it.
A damaged line never stops it; a damaged checkpoint makes it start from the one before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .events import DamagedLine, EventType, decode_line


@dataclass
class Damage:
    line: int
    reason: str
    file: str = ""


@dataclass
class WalScan:
    """One file (or Redis stream, or archive), read and checked."""
    path: Path | str
    events: list[dict[str, Any]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    """Byte offset of each event's line (an entry's index, in a stream), parallel to `events`."""
    damaged: list[Damage] = field(default_factory=list)
    torn: bytes = b""
    """A last line without its newline: the write a crash interrupted."""
    good_length: int = 0
    """Bytes up to the end of the last complete line."""

    @property
    def last_seq(self) -> int:
        return self.events[-1]["seq"] if self.events else 0

    @property
    def checkpoints(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == EventType.CHECKPOINT.value]

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.torn


def scan_bytes(path: Path | str, data: bytes) -> WalScan:
    scan = WalScan(path)
    complete = data.rfind(b"\n") + 1
    scan.good_length, scan.torn = complete, data[complete:]
    offset, last_seq = 0, 0
    for number, line in enumerate(data[:complete].splitlines(keepends=True), start=1):
        start, offset = offset, offset + len(line)
        if not line.strip():
            continue
        try:
            event = decode_line(line)
        except DamagedLine as e:
            scan.damaged.append(Damage(number, str(e), str(path)))
            continue
        if event["seq"] <= last_seq:
            scan.damaged.append(Damage(number, f"seq {event['seq']} after {last_seq}: out of order", str(path)))
            continue
        last_seq = event["seq"]
        scan.events.append(event)
        scan.offsets.append(start)
    return scan


def scan_entries(source: str, lines: Iterable[bytes]) -> WalScan:
    """The lines of a log kept as separate entries (a Redis stream): each checked as a file's
    line is, damage numbered by entry. An entry is written whole or not at all, so none is torn."""
    scan = WalScan(source)
    last_seq = 0
    for number, line in enumerate(lines, start=1):
        scan.good_length += len(line)
        try:
            event = decode_line(line)
        except DamagedLine as e:
            scan.damaged.append(Damage(number, str(e), source))
            continue
        if event["seq"] <= last_seq:
            scan.damaged.append(Damage(number, f"seq {event['seq']} after {last_seq}: out of order", source))
            continue
        last_seq = event["seq"]
        scan.events.append(event)
        scan.offsets.append(number - 1)
    return scan


def scan_file(path: Path) -> WalScan:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return WalScan(path)
    return scan_bytes(path, data)


@dataclass
class Recovery:
    checkpoint: dict[str, Any] | None
    events: list[dict[str, Any]]
    """Intact events after the checkpoint, in seq order."""
    last_seq: int
    damaged: list[Damage]


def recover(scans: Iterable[WalScan]) -> Recovery:
    """Replay over a session's files, oldest first (archive segments, then the live file)."""
    events: list[dict[str, Any]] = []
    damaged: list[Damage] = []
    for scan in scans:
        last = events[-1]["seq"] if events else 0
        events += [e for e in scan.events if e["seq"] > last]  # a seq already applied is skipped
        damaged += scan.damaged
    at = next((i for i in range(len(events) - 1, -1, -1)
               if events[i]["type"] == EventType.CHECKPOINT.value and isinstance(events[i].get("state"), dict)), None)
    checkpoint = events[at] if at is not None else None
    after = events[at + 1:] if at is not None else events
    return Recovery(checkpoint, after, events[-1]["seq"] if events else 0, damaged)


def find_checkpoint(scans: Iterable[WalScan], seq: int) -> dict[str, Any] | None:
    for scan in scans:
        for event in scan.checkpoints:
            if event["seq"] == seq and isinstance(event.get("state"), dict):
                return event
    return None
