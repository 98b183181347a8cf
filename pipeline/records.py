"""A compaction record: what a compaction point replaced the client's first messages with,
kept in the session and its log, and re-applied on every later turn (docs/compaction.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .notes import tag_legacy

NOTES_VERSION = 2
"""Records from this version on carry ctxgate's notes tagged and quoted (`pipeline/notes.py`)."""


@dataclass
class CompactionRecord:
    """`messages` replaces the client's first `prefix_len` messages (named by `prefix_hash`)."""
    prefix_len: int
    prefix_hash: str
    messages: list[dict[str, Any]]
    levels: list[str]
    tokens_before: int
    tokens_after: int
    created_at: float
    counted_by: str = ""
    """The tokenizer `tokens_after` is in (its counter's name); empty in records made before it was kept."""
    notes_version: int = NOTES_VERSION
    """1: made before ctxgate tagged its notes (`from_dict`)."""
    stable_len: int = 0
    """The client messages the record's head stands for: its messages end with a verbatim copy of
    the client's messages after them (`pipeline/stable_head.py`); 0: matched whole only."""
    stable_hash: str = ""
    """The prefix hash of the first `stable_len` client messages."""
    tail_tokens: int = 0
    """That copy's count (in `counted_by`'s tokenizer, no reply priming): the head's count is
    `tokens_after` less this."""
    rebuildable: list[list[Any]] = field(default_factory=list)
    """The head's messages the client may rebuild in place: `[client index, head index,
    fingerprint, tokens]` each (`pipeline/rebuilt.py`)."""
    segments: list[str] = field(default_factory=list)
    """The span hashes of the client's runs of the stable part before, between and after them."""
    steps: int = 0
    """The highest step number the record's messages stand for ahead of the first action they keep
    verbatim, named by a note or not (`ledger.covered_steps`): the next point numbers on from it
    (`CompressionRequest.steps_before`). 0 in records made before it was kept: numbered from
    their notes alone, as then."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CompactionRecord":
        """A stored record. One made before notes were tagged has its system-role notes tagged
        (recognised as ctxgate's because this record, ctxgate's own store, holds them); their
        text, and so the prompt, is unchanged until the session's next compaction point."""
        known = cls.__dataclass_fields__  # a field a newer replica added is left to it
        record = cls(**{"notes_version": 1, **{k: v for k, v in data.items() if k in known}})
        if record.notes_version < NOTES_VERSION:
            record.messages = [tag_legacy(m) for m in record.messages]
            record.notes_version = NOTES_VERSION
        return record
