"""The shape of a conversation: which messages must stay together and which must stay.

A *unit* is the smallest piece a strategy may drop: an assistant message with
`tool_calls` together with the `tool` results that answer it, or any other single
message. Cutting only between units keeps every tool call with its result.
"""
from __future__ import annotations

from dataclasses import dataclass

from .types import Message

INSTRUCTION_ROLES = ("system", "developer")
DEMONSTRATION_PREFIX = "Here is a demonstration of how to correctly accomplish this task"
"""How SWE-agent opens the worked example of another task it sends as the first user
message, before the real task."""


@dataclass(frozen=True)
class Unit:
    start: int
    end: int
    """Half-open: messages[start:end]."""


def split_units(messages: list[Message]) -> list[Unit]:
    units: list[Unit] = []
    i, n = 0, len(messages)
    while i < n:
        m = messages[i]
        j = i + 1
        if m.get("role") == "assistant" and m.get("tool_calls"):
            ids = {tc.get("id") for tc in m["tool_calls"] if isinstance(tc, dict)}
            while j < n and messages[j].get("role") == "tool" and messages[j].get("tool_call_id") in ids:
                j += 1
        units.append(Unit(i, j))
        i = j
    return units


def leading_instructions(messages: list[Message]) -> int:
    """How many leading system/developer messages there are (never dropped or altered)."""
    n = 0
    while n < len(messages) and messages[n].get("role") in INSTRUCTION_ROLES:
        n += 1
    return n


def first_user_index(messages: list[Message]) -> int | None:
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return i
    return None


def task_index(messages: list[Message]) -> int | None:
    """The task statement: the first user message, or the user message right after it when
    the first is a demonstration of another task (SWE-agent)."""
    first = first_user_index(messages)
    if first is None:
        return None
    content = messages[first].get("content")
    following = first + 1
    if (isinstance(content, str) and content.startswith(DEMONSTRATION_PREFIX) and following < len(messages)
            and messages[following].get("role") == "user"):
        return following
    return first


def newest_user_index(messages: list[Message]) -> int | None:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    return None


@dataclass(frozen=True)
class Shape:
    """Where a strategy may work: messages[head:tail], minus the pinned ones."""
    head: int
    """Leading instructions, plus the task statement when it is pinned and follows them."""
    tail: int
    """Start of the turn in progress (the last unit): never dropped."""
    pinned: frozenset[int]
    """Indices inside [head, tail) that are never dropped or altered: the newest user message,
    and a pinned task statement that comes after a demonstration."""
    units: tuple[Unit, ...]

    def droppable_units(self) -> list[Unit]:
        return [u for u in self.units if u.start >= self.head and u.end <= self.tail
                and not any(p in self.pinned for p in range(u.start, u.end))]


def shape_of(messages: list[Message], pin_first_user: bool = True) -> Shape:
    units = split_units(messages)
    head = leading_instructions(messages)
    task = task_index(messages)
    if pin_first_user and task == head and head < len(messages):
        head += 1
    tail = units[-1].start if units else 0
    tail = max(tail, head)
    pinned = set()
    for index in (newest_user_index(messages), task if pin_first_user else None):
        if index is not None and head <= index < tail:
            pinned.add(index)
    return Shape(head=head, tail=tail, pinned=frozenset(pinned), units=tuple(units))


def is_valid_sequence(messages: list[Message]) -> bool:
    """A provider accepts it: every tool result answers the assistant message just before
    its run of results, and every tool call has its result."""
    pending: set = set()
    for m in messages:
        role = m.get("role")
        if role == "tool":
            if m.get("tool_call_id") not in pending:
                return False
            pending.discard(m.get("tool_call_id"))
            continue
        if pending:
            return False
        if role == "assistant" and m.get("tool_calls"):
            pending = {tc.get("id") for tc in m["tool_calls"] if isinstance(tc, dict)}
    return not pending
