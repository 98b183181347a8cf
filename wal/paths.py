"""Where a session's log lives: `<data_dir>/wal/<tenant>/wal_<session>.jsonl`.

Ids reaching here were validated by the proxy; any that is still not a plain file-name
part is hashed, so nothing from a header ever becomes a path unchecked.
"""
from __future__ import annotations

import re
from pathlib import Path

import xxhash

_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}")
LIVE_PREFIX, LIVE_SUFFIX = "wal_", ".jsonl"


def safe_name(value: str) -> str:
    if _PLAIN.fullmatch(value) and ".." not in value:
        return value
    return "h-" + xxhash.xxh3_128_hexdigest(value.encode())


class WalPaths:
    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self.live_root = self.data_dir / "wal"
        self.archive_root = self.data_dir / "wal_archive"

    def live(self, tenant: str, session: str) -> Path:
        return self.live_root / safe_name(tenant) / f"{LIVE_PREFIX}{safe_name(session)}{LIVE_SUFFIX}"

    def archive_dir(self, tenant: str) -> Path:
        return self.archive_root / safe_name(tenant)

    def archives(self, tenant: str, session: str) -> list[Path]:
        """Archive segments of a session, oldest first (named by their first seq)."""
        folder = self.archive_dir(tenant)
        if not folder.is_dir():
            return []
        pattern = re.compile(re.escape(LIVE_PREFIX + safe_name(session)) + r"\.(\d+)-(\d+)" + re.escape(LIVE_SUFFIX))
        found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := pattern.fullmatch(p.name))]
        return [p for _, p in sorted(found)]

    def sessions(self, tenant: str | None = None) -> list[tuple[str, str, Path]]:
        """(tenant, session, live file) for every live log, optionally of one tenant."""
        out = []
        roots = [self.live_root / safe_name(tenant)] if tenant else sorted(self.live_root.glob("*"))
        for folder in roots:
            if not folder.is_dir():
                continue
            for f in sorted(folder.glob(f"{LIVE_PREFIX}*{LIVE_SUFFIX}")):
                out.append((folder.name, f.name[len(LIVE_PREFIX):-len(LIVE_SUFFIX)], f))
        return out
