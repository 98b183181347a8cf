"""The system messages ctxgate itself adds to a conversation, and how to recognise them.

ctxgate adds exactly these notes: Snip's "history was cut", Collapse's folded span,
Autocompact's recovery message, and activeRestore's blocks. Each starts with a fixed
marker so a later compaction can tell them from the client's own messages (restore blocks
are regenerated at every compaction, never stacked).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .types import Message

if TYPE_CHECKING:
    from .tokens import TokenCounter

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


def is_restore_block(message: Message) -> bool:
    return _starts_with(message, (RESTORE_MARKER,))


def is_ctxgate_message(message: Message) -> bool:
    return _starts_with(message, _NOTE_MARKERS + (RESTORE_MARKER,))


def shed_own_messages(messages: list[Message], counter: "TokenCounter", limit: int,
                      notes: bool = False) -> list[Message] | None:
    """`messages` without as many of ctxgate's own messages as it takes to fit `limit` tokens:
    the restore blocks, the least important (the last) first, then with `notes` the compaction
    notes, the oldest first; None if they do not fit even without all of those. A request over
    the budget gives up what ctxgate added before anything the client sent: the newest steps
    verbatim are worth more than a list of what came before them, and a request the provider
    refuses is worth nothing."""
    order = [i for i in range(len(messages) - 1, -1, -1) if is_restore_block(messages[i])]
    if notes:
        order += [i for i, m in enumerate(messages) if is_compaction_note(m)]
    tokens, dropped = counter.count_messages(messages), set()
    for i in order:
        if tokens <= limit:
            break
        dropped.add(i)
        tokens -= counter.count_structured(messages[i])
    if tokens > limit:
        return None
    return [m for i, m in enumerate(messages) if i not in dropped]
