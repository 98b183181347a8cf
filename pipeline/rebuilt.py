"""A message a compaction point kept verbatim in its head, rebuilt in place by the agent
(docs/compaction.md, rebuilt scaffolding).

An agent may rebuild some of the messages before its history every turn: aider's repo map and
its files-in-chat message (the files' current text) stand before the history a point compacts,
and change when the files do. The point kept them verbatim beside its notes, so its head holds
their old text. A request whose stable part differs from the record's only in such messages, at
the same places, with everything else in it unchanged (each run of client messages between them
named by its span hash), still matches: the head with the client's current version of each in
its place. The notes stand for runs the client did not change, so none of them is stale; the
rebuilt message is the client's own, as sent. The task statement is not one of them (a summary
is written towards it), nor a message whose text the stable part holds more than once (which
copy the head kept is not known), nor one that moved.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, Sequence

from .budget import Turn
from .fingerprint import message_fingerprint, span_hash
from .notes import TAG
from .records import CompactionRecord
from .turns import task_index

Message = dict[str, Any]


def with_rebuildable(record: CompactionRecord, turn: Turn, head: Sequence[Message]) -> CompactionRecord:
    """`record` (its stable part set) with the messages of its `head` that may be rebuilt in place:
    each `[client index, head index, fingerprint, tokens]`, and the span hashes of the client's
    runs before, between and after them up to the stable part's end."""
    stable = record.stable_len
    fps = turn.fingerprints[:stable]
    seen = Counter(fps)
    once = {fp: i for i, fp in enumerate(fps) if seen[fp] == 1}
    task = task_index(turn.messages)
    kept: list[list[Any]] = []
    for h, message in enumerate(head):
        if TAG in message:
            continue
        fp = message_fingerprint(message)
        i = once.get(fp)
        if i is not None and i != task:
            kept.append([i, h, fp, turn.counter.count_structured(message, fp)])
    if not kept:
        return record
    kept.sort()
    bounds = [-1, *(k[0] for k in kept), stable]
    segments = [span_hash(fps[a + 1:b]) for a, b in zip(bounds, bounds[1:])]
    return replace(record, rebuildable=kept, segments=segments)


def rebuilt_head(record: CompactionRecord, turn: Turn, head: list[Message]) -> tuple[list[Message], int] | None:
    """`head` with the client's current version of each rebuildable message that changed, and the
    tokens that adds (less what it takes out), when everything else in the record's stable part
    is unchanged; else None."""
    stable, fps = record.stable_len, turn.fingerprints
    if not record.rebuildable or len(fps) < stable:
        return None
    bounds = [-1, *(k[0] for k in record.rebuildable), stable]
    if any(span_hash(fps[a + 1:b]) != h for a, b, h in zip(bounds, bounds[1:], record.segments)):
        return None
    out, added = list(head), 0
    for i, h, fp, tokens in record.rebuildable:
        if fps[i] != fp:
            out[h] = turn.messages[i]
            added += turn.counter.count_structured(turn.messages[i], fps[i]) - tokens
    return out, added
