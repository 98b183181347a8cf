"""Project memory from the file system (refreshed at session start, incrementally).

Only files modified since `last_scan` are looked at again; nothing outside the root is
ever read: symbolic links are not followed, and a path that resolves outside is skipped.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .capture import MANIFEST_LANGUAGE, project_facts

SKIP_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", ".venv", "venv", "__pycache__", ".mypy_cache",
                       ".pytest_cache", "dist", "build", ".tox", "target", ".idea", ".ctxgate"})
MAX_FILES = 5000
_MANIFEST_NAMES = frozenset(MANIFEST_LANGUAGE)


def scan_project(root: str | Path, previous: dict[str, Any] | None = None, now: float | None = None) -> dict[str, Any]:
    """Project memory's data: root_path, file_index, tech_stack, conventions, last_scan."""
    base = Path(root).resolve()
    at = time.time() if now is None else now
    prev = previous or {}
    last_scan = float(prev.get("last_scan") or 0.0)
    old_index: dict[str, dict[str, Any]] = dict(prev.get("file_index") or {})
    index: dict[str, dict[str, Any]] = {}
    stack: dict[str, Any] = dict(prev.get("tech_stack") or {})
    changed = 0
    for folder, dirs, files in os.walk(base, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            path = Path(folder) / name
            try:
                if path.is_symlink() and not path.resolve().is_relative_to(base):
                    continue
                st = path.stat()
            except OSError:
                continue
            rel = path.relative_to(base).as_posix()
            index[rel] = {"size": st.st_size, "mtime": st.st_mtime}
            fresh = st.st_mtime > last_scan or rel not in old_index
            changed += fresh
            if fresh and name in _MANIFEST_NAMES and st.st_size < 200_000:
                try:
                    facts = project_facts(path.read_text(errors="replace"), at)
                except OSError:
                    facts = []
                for fact in facts:
                    stack.update(fact.data.get("tech_stack", {}))
            if len(index) >= MAX_FILES:
                break
        if len(index) >= MAX_FILES:
            break
    return {"root_path": str(base), "file_index": index, "tech_stack": stack,
            "conventions": _conventions(index, prev.get("conventions") or []), "last_scan": at,
            "changed_files": changed, "removed_files": sorted(set(old_index) - set(index))}


def _conventions(index: dict[str, Any], known: list[str]) -> list[str]:
    found = list(known)
    tops = {p.split("/", 1)[0] for p in index if "/" in p}
    for folder, rule in (("tests", "tests live in tests/"), ("src", "sources live in src/"),
                         ("docs", "documentation lives in docs/")):
        if folder in tops and rule not in found:
            found.append(rule)
    return found


def describe(project: dict[str, Any]) -> str:
    """The text the loader injects for a scanned project."""
    stack = project.get("tech_stack") or {}
    parts = [f"Project at {project.get('root_path')}: {len(project.get('file_index') or {})} files"]
    if stack.get("language"):
        parts.append(f"language {stack['language']}" + (f" ({', '.join(stack.get('frameworks') or [])})"
                                                         if stack.get("frameworks") else ""))
    if project.get("conventions"):
        parts.append("; ".join(project["conventions"]))
    return ". ".join(parts) + "."
