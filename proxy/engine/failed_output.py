"""Whether a tool's output reads as a failure: the WAL's TOOL_RESULT `success`.

`FAILURE`, searched case-insensitively in the first `SCAN_CHARS` characters. Python's regular
expressions give it ~15 µs a kilobyte (a case-folded alternation behind `\\b`: no literal to
skip ahead to), 5.7 ms for the 101 tool outputs of a new 107K-token conversation, which its
reply waits for (its messages are logged first). So an ASCII text, nearly every one, is
lowered once and its literals found with `str.find`, the same answer for a fraction of the
time (on ASCII, case-folding is lowering and `\\w` is letters, digits and `_`); any other text
goes to the pattern.
"""
from __future__ import annotations

import re

FAILURE = re.compile(r"(?i)traceback \(most recent call last\)|\berror\b|\bexception\b|command not found|"
                     r"no such file or directory|exit code [1-9]")
SCAN_CHARS = 4000
_PHRASES = ("traceback (most recent call last)", "command not found", "no such file or directory")
_WORDS = ("error", "exception")
_EXIT = "exit code "


def failed(text: str) -> bool:
    """`FAILURE` is in the first `SCAN_CHARS` characters of `text`."""
    head = text[:SCAN_CHARS]
    if not head.isascii():
        return FAILURE.search(head) is not None
    low = head.lower()
    return (any(p in low for p in _PHRASES) or any(_word_in(low, w) for w in _WORDS)
            or any(low[at + len(_EXIT):at + len(_EXIT) + 1] in _NONZERO for at in _finds(low, _EXIT)))


def first_failure_line(text: str) -> str:
    """The first line of the scanned part that reads as a failure, stripped and cut to 200 characters."""
    for line in text[:SCAN_CHARS].splitlines():
        if failed(line):
            return line.strip()[:200]
    return ""


_NONZERO = frozenset("123456789")


def _finds(text: str, literal: str) -> list[int]:
    out = []
    at = text.find(literal)
    while at >= 0:
        out.append(at)
        at = text.find(literal, at + 1)
    return out


def _word_in(low: str, word: str) -> bool:
    """`\\bword\\b` in an ASCII text."""
    return any((at == 0 or not _is_word(low[at - 1])) and not _is_word(low[at + len(word):at + len(word) + 1])
               for at in _finds(low, word))


def _is_word(char: str) -> bool:
    return char.isalnum() or char == "_"
