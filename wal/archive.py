"""Keeping the live log small (docs/wal.md, archive and retention): old events move to `wal_archive/`.

A segment is named `wal_<session>.<first seq>-<last seq>.jsonl`; segments past their
retention are removed. Files are replaced atomically (write, fsync, rename), so a crash
mid-archive leaves either the old or the new file, never half of one.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from .events import decode_line
from .records import expand_first_checkpoint


def write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def prune_folder(folder: Path, ttl_s: float, keep: int, pattern: str = "*.json") -> None:
    """Remove the files of `folder` older than `ttl_s`, then the oldest beyond `keep`: the
    bound of a per-tenant folder of stored replies."""
    entries = []
    now = time.time()
    for f in folder.glob(pattern):
        try:
            mtime = f.stat().st_mtime
        except FileNotFoundError:
            continue
        if now - mtime > ttl_s:
            f.unlink(missing_ok=True)
        else:
            entries.append((mtime, f))
    for _, f in sorted(entries)[:max(0, len(entries) - keep)]:
        f.unlink(missing_ok=True)


def remove(path: Path) -> bool:
    """Delete `path`; whether it was there."""
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def remove_matching(folder: Path, matches: Callable[[bytes], bool], pattern: str = "*.json") -> int:
    """Delete the files of `folder` whose bytes `matches` (one it cannot read is kept); how many."""
    removed = 0
    for path in folder.glob(pattern) if folder.is_dir() else []:
        try:
            if not matches(path.read_bytes()):
                continue
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue
        removed += remove(path)
    return removed


def archive_segment(live: Path, archive_dir: Path, split_at: int, now: float | None = None) -> Path | None:
    """Move the live file's bytes before `split_at` (the start of a checkpoint line) to a
    new archive segment and keep the rest live. The caller holds the file's lock. The
    segment is dated `now` (retention counts from it)."""
    data = live.read_bytes()
    head, tail = data[:split_at], data[split_at:]
    lines = [ln for ln in head.splitlines(keepends=True) if ln.strip()]
    if not lines:
        return None
    first, last = _seq_of(lines[0]), _seq_of(lines[-1])
    session = live.name[len("wal_"):-len(".jsonl")]
    segment = archive_dir / f"wal_{session}.{first}-{last}.jsonl"
    write_atomically(segment, head)
    if now is not None:
        os.utime(segment, (now, now))
    write_atomically(live, expand_first_checkpoint(head, tail))
    return segment


def _seq_of(line: bytes) -> int:
    try:
        return decode_line(line)["seq"]
    except ValueError:
        return 0


def prune_archives(archive_root: Path, retention_s: float, now: float) -> list[Path]:
    """Remove archive segments last written more than `retention_s` before `now`."""
    removed: list[Path] = []
    if not archive_root.is_dir():
        return removed
    for segment in archive_root.glob("*/wal_*.jsonl"):
        try:
            if now - segment.stat().st_mtime > retention_s:
                segment.unlink()
                removed.append(segment)
        except FileNotFoundError:
            continue
    return removed
