"""Checkpoints that name the compaction records an earlier checkpoint of the same file holds.

A checkpoint is the session's whole state, and most of that is its compaction records
(compacted message lists, often 10-100 KB each), which change only when a compaction adds
one. So a checkpoint writes in full only the records its file does not hold yet, and names
the others (`{"ref": key}`): a compacting turn writes its new record, not all of them again.

Every file still reads back on its own: the archive pass, which starts a new live file at a
checkpoint, writes that checkpoint with all its records (`expand_first_checkpoint`), so the
first checkpoint of every file, live or archived, holds its records in full.
"""
from __future__ import annotations

from typing import Any, Iterable

from .events import DamagedLine, EventType, decode_line, encode_line

REF = "ref"


def record_key(record: dict[str, Any]) -> str:
    """What makes a record unique, without reading its messages."""
    return f"{record['prefix_len']}:{record['prefix_hash']}:{record['created_at']!r}"


def is_ref(record: Any) -> bool:
    return isinstance(record, dict) and set(record) == {REF}


def full_records(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every record the checkpoints among `events` hold in full, by key."""
    found: dict[str, dict[str, Any]] = {}
    for event in events:
        state = event.get("state") if event.get("type") == EventType.CHECKPOINT.value else None
        if isinstance(state, dict):
            for record in state.get("records") or []:
                if isinstance(record, dict) and not is_ref(record):
                    found[record_key(record)] = record
    return found


def resolved(state: dict[str, Any], known: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """`state` with its named records replaced by the records `known` holds, and the keys of
    those it does not hold (left out of the state)."""
    records, missing = [], []
    for record in state.get("records") or []:
        if is_ref(record):
            if record[REF] in known:
                records.append(known[record[REF]])
            else:
                missing.append(record[REF])
        else:
            records.append(record)
    return {**state, "records": records}, missing


def expand_first_checkpoint(head: bytes, tail: bytes) -> bytes:
    """`tail`, whose first line is a checkpoint that may name records `head` holds, with that
    checkpoint written in full: the start of a file that reads back without `head`."""
    end = tail.find(b"\n") + 1
    if end == 0:
        return tail
    event = decode_line(tail[:end])
    state = event.get("state")
    if event.get("type") != EventType.CHECKPOINT.value or not isinstance(state, dict) or not any(
            is_ref(r) for r in state.get("records") or []):
        return tail
    full, _ = resolved(state, full_records(_events(head)))
    return encode_line({**event, "state": full}) + tail[end:]


def _events(data: bytes) -> Iterable[dict[str, Any]]:
    for line in data.splitlines(keepends=True):
        try:
            yield decode_line(line)
        except DamagedLine:  # recovery reports it; here it only holds no record
            continue
