"""The line of an observation that says what failed.

The conversation model judges every observation with it (`protocols.base.observation`):
Collapse never folds a failed observation, and activeRestore brings the key line of the
latest one back when a compaction took it out of view: what went wrong last is what the
agent acts on next.
"""
from __future__ import annotations

import re

ERROR_MARKERS = ("Traceback", "Error", "error:")
_LISTING_LINE = re.compile(r"^\s*\d+(?::|\t|\s{2,}|\|)")
"""A numbered line of a file view (`317:    raise ValueError(`, `cat -n` output, OpenHands'
`12|`): code, not a failure."""
KEY_LINE_CHARS = 300


def is_error_line(line: str) -> bool:
    """The line carries an error marker and is not a numbered line of a file view."""
    return any(m in line for m in ERROR_MARKERS) and not _LISTING_LINE.match(line)


def key_error_line(text: str) -> str:
    """The last line of `text` with an error marker, file-view lines excluded; a marker line
    too short to say anything ("Error:") comes with the line after it. Empty if none."""
    if not any(marker in text for marker in ERROR_MARKERS):
        return ""
    lines = [line.strip() for line in text.splitlines()]
    found = [i for i, line in enumerate(lines) if is_error_line(line)]
    if not found:
        return ""
    at = found[-1]
    key = lines[at]
    if len(key) < 12:
        following = next((line for line in lines[at + 1:] if line), "")
        key = f"{key}\n{following}" if following else key
    return key[:KEY_LINE_CHARS]
