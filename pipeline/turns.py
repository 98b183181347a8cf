"""Where the fixed points of a conversation are: its leading instructions, its task
statement, its newest user message; and whether a provider accepts a message sequence.
How messages group into steps is the conversation model's (`conversation.py`)."""
from __future__ import annotations

import re
from typing import Any

from .notes import TAG
from .types import Message

INSTRUCTION_ROLES = ("system", "developer")
DEMONSTRATION_PREFIX = "Here is a demonstration of how to correctly accomplish this task"
"""How SWE-agent opens the worked example of another task it sends as the first user
message, before the real task."""
EXAMPLES_CLOSER = "I switched to a new code base. Please don't consider the above files"
"""How aider closes the worked examples of its edit format, sent as user and assistant turns
right after its system prompt: they and the reply to this turn are instructions, not the task."""
EXAMPLES_SCAN = 24
"""How far past the system messages the examples' closing turn is looked for."""
_ACKNOWLEDGEMENT = re.compile(r"Ok\.?|Ok, (?:I will use these|I won't try and edit|any changes I propose will be to)"
                             r"[^\n]{0,60}")
"""A reply a client writes itself to context it hands over in a user turn (aider's "Ok.",
"Ok, I will use these files as references."): that user turn is not the task."""


_TEXT_PARTS = ("text", "input_text", "output_text")


def plain_text(message: Message) -> str | None:
    """A message's text when it is only text: a string, or a list of text parts (how the
    Messages and Responses APIs carry the same turn); None when it holds anything else (a
    tool call or result, an image), which no rule here reads as talk."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    if not all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)
               for p in content):
        return None
    return "".join(p["text"] for p in content)


def leading_instructions(messages: list[Message]) -> int:
    """How many messages open the request as instructions (never dropped or altered): the
    leading system/developer messages, and the worked examples a client closes itself after
    them (`EXAMPLES_CLOSER`), through the reply to the closing turn."""
    n = 0
    while n < len(messages) and messages[n].get("role") in INSTRUCTION_ROLES and TAG not in messages[n]:
        n += 1
    for i in range(n, min(len(messages), n + EXAMPLES_SCAN)):
        m = messages[i]
        text = plain_text(m)
        if m.get("role") not in ("user", "assistant") or m.get("tool_calls") or text is None or TAG in m:
            break
        if m["role"] == "user" and text.startswith(EXAMPLES_CLOSER):
            replied = i + 1 < len(messages) and messages[i + 1].get("role") == "assistant"
            return i + 2 if replied else i + 1
    return n


def first_user_index(messages: list[Message], start: int = 0) -> int | None:
    """The first user message from `start` on that the client sent (not one of ctxgate's notes)."""
    return next((i for i in range(start, len(messages)) if messages[i].get("role") == "user"
                 and TAG not in messages[i]), None)


def task_index(messages: list[Message]) -> int | None:
    """The task statement: the first user message after the instructions, or the user message
    right after it when the first is a demonstration of another task (SWE-agent). A user turn
    the client answers itself (`_ACKNOWLEDGEMENT`) is context, not the task, when a user
    message follows it."""
    first = first_user_index(messages, leading_instructions(messages))
    while first is not None and _acknowledged(messages, first):
        later = first_user_index(messages, first + 2)
        if later is None:
            break
        first = later
    if first is None:
        return None
    text = plain_text(messages[first])
    following = first + 1
    if (text is not None and text.startswith(DEMONSTRATION_PREFIX) and following < len(messages)
            and messages[following].get("role") == "user"):
        return following
    return first


def _acknowledged(messages: list[Message], user: int) -> bool:
    """The turn after `messages[user]` is the client's own acknowledgement of it."""
    reply = messages[user + 1] if user + 1 < len(messages) else {}
    text = plain_text(reply)
    return (reply.get("role") == "assistant" and not reply.get("tool_calls") and text is not None
            and _ACKNOWLEDGEMENT.fullmatch(text.strip()) is not None)


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
        if messages[i].get("role") == "user" and TAG not in messages[i]:
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
