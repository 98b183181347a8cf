"""How much of a request a compaction record still stands for, when the agent rebuilt the
messages after what the record compacted (docs/compaction.md, rebuilt scaffolding).

A record replaces the client's first `prefix_len` messages with `messages`, and those end
with a verbatim copy of the client's newest messages (the recent window, as sent). Only what
comes before that copy, the record's *head* (the kept instructions and task, the notes, the
restored state, whatever a level cut or folded), is ctxgate's work, and it stands for the
client's first `stable_len` messages. An agent that rebuilds its scaffolding every turn (aider
appends its reminder to the newest user message and moves its files-in-chat message after its
history) resends a history whose newest messages are not the ones the record copied, though
every message the point compacted is unchanged. Such a request is matched by the stable part:
the head, then the client's messages after the stable part as they are now. A request that
changed anything within the stable part (a message the point summarised, dropped or kept
beside its notes) matches by neither rule: the record is not applied, and no note about what
the client no longer says is forwarded.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from .budget import Turn
from .fingerprint import message_fingerprint
from .rebuilt import rebuilt_head, with_rebuildable
from .records import CompactionRecord
from .tokens import REPLY_PRIMING

Message = dict[str, Any]


@dataclass(frozen=True)
class Match:
    """A record applied to a request: `head` stands for the client's first `covered` messages."""
    record: CompactionRecord
    covered: int
    head: list[Message]
    whole: bool
    """The request starts with every message the record replaced (`covered` is its `prefix_len`)."""
    added: int = 0
    """What the client's rebuilt messages in `head` add to its count (`pipeline/rebuilt.py`)."""


def verbatim_tail(out: Sequence[Message], fingerprints: Sequence[str]) -> int:
    """How many of `out`'s last messages are the client's last messages (named by
    `fingerprints`), byte for byte as ctxgate reads them, in the same order."""
    n = 0
    while n < len(out) and n < len(fingerprints) and message_fingerprint(out[-1 - n]) == fingerprints[-1 - n]:
        n += 1
    return n


def with_stable_head(record: CompactionRecord, turn: Turn) -> CompactionRecord:
    """`record`, made over `turn`'s messages, with its stable part: the client messages its head
    stands for. None (a whole match only) when its messages end with no copy of the client's
    newest ones (a point that cut the last message) or are nothing but such a copy."""
    tail = verbatim_tail(record.messages, turn.fingerprints)
    stable = record.prefix_len - tail
    if tail == 0 or stable <= 0 or tail >= len(record.messages):
        return record
    stable_record = replace(record, stable_len=stable, stable_hash=turn.prefix_hashes[stable - 1],
                            tail_tokens=turn.message_tokens(stable) - REPLY_PRIMING)
    return with_rebuildable(stable_record, turn, record.messages[:len(record.messages) - tail])


def match(record: CompactionRecord, turn: Turn) -> Match | None:
    """`record` applied to `turn`'s messages: whole when they start with every message it
    replaced, else by its stable part, as it is or with messages it kept rebuilt in place by
    the client (`pipeline/rebuilt.py`), else None."""
    k, hashes = record.prefix_len, turn.prefix_hashes
    if 0 < k <= len(hashes) and hashes[k - 1] == record.prefix_hash:
        return Match(record, k, record.messages, True)
    j = record.stable_len
    if not 0 < j <= len(hashes):
        return None
    head = record.messages[:len(record.messages) - (k - j)]
    if hashes[j - 1] == record.stable_hash:
        return Match(record, j, head, False)
    rebuilt = rebuilt_head(record, turn, head)
    return Match(record, j, rebuilt[0], False, rebuilt[1]) if rebuilt is not None else None


def best_match(records: Sequence[CompactionRecord], turn: Turn) -> Match | None:
    """The newest record (the longest `prefix_len`: a record replaces those at or past its
    length) that `turn` matches, whole or by its stable part."""
    for record in sorted(records, key=lambda r: r.prefix_len, reverse=True):
        found = match(record, turn)
        if found is not None:
            return found
    return None
