"""What a session's earlier compaction points make of a request: the longest matching record's
replacement in front of what arrived since, with the expansion exchanges of answered turns
back in place (docs/compaction.md, records and prefix stability; docs/expansion.md)."""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from .budget import Turn
from .notes import with_notice
from .records import CompactionRecord
from .stable_head import Match, best_match
from .tokens import REPLY_PRIMING, TokenCounter


class SessionFacts(Protocol):
    """What the planner reads of a session: plain data the engine loads (its `SessionState`)."""
    @property
    def records(self) -> Sequence[CompactionRecord]: ...
    @property
    def expanded(self) -> Sequence[dict[str, Any]]: ...
    @property
    def collapse(self) -> dict[str, Any]: ...
    @property
    def breaker(self) -> dict[str, Any]: ...
    @property
    def learned_max_input_tokens(self) -> int | None: ...


def apply_records(facts: SessionFacts, turn: Turn,
                  exchanges: bool = True) -> tuple[list[dict[str, Any]], Match | None, int]:
    """The client's messages with the newest matching record's replacement in front (whole, or
    its head by its stable part: `stable_head.match`), that match, and the tokens the expansion
    exchanges put back add. What arrived since is forwarded as the client sent it: it is the
    recent window, with the expansion exchanges of its answered turns back in place (unless
    `exchanges` is False: `compaction_view`)."""
    found = best_match(facts.records, turn)
    if found is None:
        if not exchanges:
            return list(turn.messages), None, 0
        view, added = with_expanded(facts, turn, turn.messages, 0, 0)
        return view, None, added
    view = found.head + turn.messages[found.covered:]
    if not exchanges:
        return view, found, 0
    view, added = with_expanded(facts, turn, view, found.covered, len(found.head))
    return view, found, added


def forwarded_view(facts: SessionFacts, turn: Turn) -> tuple[list[dict[str, Any]], int]:
    """What to forward as the records have it, and its size as the provider counts it:
    the record's own count (less its copy of the client's newest messages, when it matched by
    its stable part) plus the turn's count of what follows, O(new messages)."""
    view, found, expanded = apply_records(facts, turn)
    if found is None:
        return view, turn.message_tokens() + expanded + turn.outside_tokens()
    return view, head_tokens(found, turn.counter) + turn.message_tokens(found.covered) - REPLY_PRIMING \
        + expanded + turn.outside_tokens()


def compaction_view(facts: SessionFacts, turn: Turn) -> list[dict[str, Any]]:
    """What a compaction point compacts: the view without the expansion exchanges of earlier
    turns. Each result is a copy of an original still stored under the reference a note
    names; compacting it again would store a copy of that copy under a new reference, with a
    preview naming references the model had already expanded, and a model that expands what
    it sees would ask for them all over again (measured on check_pipeline's run: the notes
    of one point held the calls of the last, and the next point came a turn sooner). The
    point breaks the cached prefix anyway, and what was expanded can be asked for again."""
    return apply_records(facts, turn, exchanges=False)[0]


def with_expanded(facts: SessionFacts, turn: Turn, view: list[dict[str, Any]], covered: int,
                  replaced_by: int) -> tuple[list[dict[str, Any]], int]:
    """`view` (the client's first `covered` messages replaced by `replaced_by` others) with each
    expansion exchange after the client's message it followed, when that message is after
    what is replaced and the history up to it is unchanged; and the tokens they add. The
    forwarded request then starts with the previous turn's last follow-up, as the provider
    cached it."""
    hashes = turn.prefix_hashes
    found = [e for e in facts.expanded if covered <= e["prefix_len"] <= len(hashes)
             and hashes[e["prefix_len"] - 1] == e["prefix_hash"]]
    if not found:
        return view, 0
    out = list(view)
    for entry in sorted(found, key=lambda e: e["prefix_len"], reverse=True):
        at = entry["prefix_len"] - covered + replaced_by
        out[at:at] = entry["messages"]
    added = turn.counter.count_messages([m for e in found for m in e["messages"]]) - REPLY_PRIMING
    return out, added


def head_tokens(found: Match, counter: TokenCounter) -> int:
    """The matched head as `counter` counts it: from the record's stored count when it was made
    with that counter (every turn after a compaction re-applies the record: no recount)."""
    record = found.record
    if record.counted_by != counter.name:
        return counter.count_messages(with_notice(found.head))
    return record.tokens_after if found.whole else record.tokens_after - record.tail_tokens + found.added
