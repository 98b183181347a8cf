"""Where the fixed points of a conversation are: its leading instructions, its task
statement, its newest user message; and whether a provider accepts a message sequence.
How messages group into steps is the conversation model's (`conversation.py`)."""
from __future__ import annotations

from typing import Any

from .types import Message

INSTRUCTION_ROLES = ("system", "developer")
DEMONSTRATION_PREFIX = "Here is a demonstration of how to correctly accomplish this task"
"""How SWE-agent opens the worked example of another task it sends as the first user
message, before the real task."""


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


def kept_characters(messages: list[Message]) -> int:
    """The characters of text in what every level keeps whole at any budget: the leading
    instructions and the task statement. Read from string lengths only, so it costs nothing
    however large the texts are."""
    kept = set(range(leading_instructions(messages)))
    task = task_index(messages)
    if task is not None:
        kept.add(task)
    return sum(_text_characters(messages[i].get("content")) for i in kept)


def _text_characters(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def newest_user_index(messages: list[Message]) -> int | None:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    return None


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
