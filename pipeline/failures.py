"""Failures in tool output: which observations report one, and the line that says what.

Collapse keeps the latest failing observation in view, and activeRestore brings its key
line back when a compaction took the observation away: what went wrong last is what the
agent acts on next.
"""
from __future__ import annotations

import re

from .types import Message

ERROR_MARKERS = ("Traceback", "Error", "error:")
_LISTING_LINE = re.compile(r"^\s*\d+(?::|\t|\s{2,})")
"""A numbered line of a file view (`317:    raise ValueError(`, `cat -n` output): code, not a failure."""
KEY_LINE_CHARS = 300


def reports_error(message: Message) -> bool:
    """A tool result or an observation (SWE-agent style, in a user message) that reports a failure."""
    content = message.get("content")
    return (message.get("role") in ("tool", "user") and isinstance(content, str)
            and any(marker in content for marker in ERROR_MARKERS))


def key_error_line(text: str) -> str:
    """The last line of `text` with an error marker, file-view lines excluded; a marker line
    too short to say anything ("Error:") comes with the line after it. Empty if none."""
    lines = [line.strip() for line in text.splitlines()]
    found = [i for i, line in enumerate(lines) if any(m in line for m in ERROR_MARKERS)
             and not _LISTING_LINE.match(line)]
    if not found:
        return ""
    at = found[-1]
    key = lines[at]
    if len(key) < 12:
        following = next((line for line in lines[at + 1:] if line), "")
        key = f"{key}\n{following}" if following else key
    return key[:KEY_LINE_CHARS]


def latest_error_line(messages: list[Message]) -> str:
    """The key line of the newest observation that reports a failure."""
    for message in reversed(messages):
        if reports_error(message):
            line = key_error_line(message["content"])
            if line:
                return line
    return ""
