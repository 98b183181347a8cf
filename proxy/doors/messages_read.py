"""A Messages session's last request as the door read it, so its next request is checked and
read from its first new message on.

A stateless client resends its whole conversation every turn. Kept with the session's history
(`HistoryCache.door_state`), this lets a steady turn check only its new messages, look for a
compaction block only among them, and make the neutral model only of them: the earlier
messages' plain copies are the last request's own objects, so the history cache matches them
by identity. Claude Code moves its cache breakpoint to the newest message every turn: the
message that carried it is sent again without it, so the known prefix may end a few messages
before the last request's end (`MOVED`); what follows it is read anew.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .messages_compaction import COMPACTION
from .messages_model import Conversation, Message, unmarked

MOVED = 8
"""The last request's newest messages that may differ (a breakpoint taken off them) while those
before them are the same: compared one by one; the earlier ones in one comparison."""


@dataclass(frozen=True)
class ReadMessages:
    system: Any
    messages: list[Message]
    """The request's messages as the client sent them (checked)."""
    compacted: bool
    """Whether any of them holds a compaction block (`messages_compaction.expanded` looks
    through all of them then)."""
    neutral: list[Message] | None = None
    """Their neutral model (`Conversation.neutral`); None when context edits or an expanded
    compaction block made it of other messages."""
    marks: dict[int, int] | None = None
    """For each plain copy in `neutral` of a message sent with breakpoints: its id → its index there."""


def known_messages(last: Any, system: Any, messages: Any) -> int:
    """How many leading messages of a request were its session's last request's own, checked
    then (0: another conversation, an edited earlier turn, a retry of an earlier turn, another
    system prompt)."""
    if not isinstance(last, ReadMessages) or not isinstance(messages, list) or system != last.system:
        return 0
    n = len(last.messages)
    if len(messages) < n:
        return 0
    before = max(0, n - MOVED)
    known = next((i for i in range(before, n) if messages[i] != last.messages[i]), n)
    return known if messages[:before] == last.messages[:before] else 0


def compacted(messages: list[Message], last: ReadMessages | None, known: int) -> bool:
    """Whether the messages hold a compaction block: looked for in the new ones only when the
    last request's held none."""
    start = known if last is not None and not last.compacted else 0
    return any(isinstance(b, dict) and b.get("type") == COMPACTION for m in messages[start:]
               if isinstance(content := m.get("content"), list) for b in content)


@dataclass(frozen=True)
class ReadAt:
    """Where a request's reading starts: its session's last request as read, how many of its
    leading messages that had (`known_messages`), whether its messages hold a compaction block
    (`compacted`)."""
    last: ReadMessages | None
    known: int
    blocks: bool


def read_messages(body: dict[str, Any], at: ReadAt) -> tuple[Conversation, ReadMessages]:
    """The body's conversation in the neutral model (`messages_model.conversation_of`) and what
    the next turn reads on from: made for the messages from `at.known` on, those before them
    taken from the last request's reading when it has them."""
    system, messages = body.get("system"), body["messages"]
    last, known = at.last, at.known
    offset = 1 if system else 0
    if last is not None and last.neutral is not None and last.marks is not None and known:
        neutral = last.neutral[:offset + known]
        marks = {pid: at for pid, at in last.marks.items() if at < offset + known}
        start = known
    else:
        neutral, marks, start = ([{"role": "system", "content": system}] if system else []), {}, 0
    for i in range(start, len(messages)):
        plain = unmarked(messages[i])
        if plain is not messages[i]:
            marks[id(plain)] = len(neutral)
        neutral.append(plain)
    marked = {pid: messages[at - offset] for pid, at in marks.items()}
    read = ReadMessages(system, list(messages), at.blocks, list(neutral), marks)
    return Conversation(body, neutral, marked), read
