"""The system messages ctxgate itself adds to a conversation, and how to recognise them.

ctxgate adds exactly these notes: Snip's "history was cut", Collapse's folded span,
Autocompact's recovery message, and activeRestore's blocks. Each starts with a fixed
marker so a later compaction can tell them from the client's own messages (restore blocks
are regenerated at every compaction, never stacked).
"""
from __future__ import annotations

from .types import Message

SNIP_MARKER = "[ctxgate: context snipped]"
COLLAPSE_MARKER = "[ctxgate: collapsed context]"
AUTOCOMPACT_MARKER = "[ctxgate: context compaction point (Autocompact)]"
RESTORE_MARKER = "[ctxgate: restored state]"

_NOTE_MARKERS = (SNIP_MARKER, COLLAPSE_MARKER, AUTOCOMPACT_MARKER)


def system_note(text: str) -> Message:
    return {"role": "system", "content": text}


def _starts_with(message: Message, markers: tuple[str, ...]) -> bool:
    content = message.get("content")
    return message.get("role") == "system" and isinstance(content, str) and content.startswith(markers)


def is_compaction_note(message: Message) -> bool:
    """A Snip, Collapse or Autocompact note."""
    return _starts_with(message, _NOTE_MARKERS)


def is_summary_note(message: Message) -> bool:
    """Autocompact's recovery message: a summary of what it replaced."""
    return _starts_with(message, (AUTOCOMPACT_MARKER,))


def is_restore_block(message: Message) -> bool:
    return _starts_with(message, (RESTORE_MARKER,))


def is_ctxgate_message(message: Message) -> bool:
    return _starts_with(message, _NOTE_MARKERS + (RESTORE_MARKER,))


def merged_note(count: int, ref: str) -> Message:
    """One note in the place of `count` earlier compaction notes, merged without a summary
    call: their text is kept under `ref`, so the model can ask for it."""
    notes = "1 earlier compaction note was" if count == 1 else f"{count} earlier compaction notes were"
    return system_note(f"{SNIP_MARKER} {notes} merged to fit the context budget (the originals: ref {ref}).")
