"""Which text protocol a conversation speaks, judged from its own messages."""
from __future__ import annotations

from typing import Any

from .base import TextReader, text_of
from .mini_swe_agent import MiniSweAgentReader
from .openhands import OpenHandsReader
from .plain import PlainReader
from .swe_agent import SweAgentReader

PLAIN = "plain"
TEXT_READERS: dict[str, TextReader] = {r.name: r for r in (OpenHandsReader(), MiniSweAgentReader(),
                                                             SweAgentReader(), PlainReader())}
"""In order of precedence: a tie goes to the more specific form."""
STRUCTURAL_DIALECTS = ("tool_calls", "anthropic_blocks")
"""Dialects with no text protocol: actions and results are structured fields, read anywhere."""
DETECT_WINDOW = 60
"""Messages looked at: enough to see a protocol, and a constant cost however long the history."""


def text_reader(dialect: str) -> TextReader | None:
    """The reader of a dialect's text turns; None for a structural dialect, whose text turns
    are talk (a tool-calling agent's user turns are its user's words, not observations)."""
    return None if dialect in STRUCTURAL_DIALECTS else TEXT_READERS.get(dialect, TEXT_READERS[PLAIN])


def detect_dialect(messages: list[dict[str, Any]], task: int | None = None) -> str:
    """The text protocol most of the recent turns are unmistakably in; else the structural
    one they use (`tool_calls`, `anthropic_blocks`); else `plain`. The task statement and
    the instructions are not evidence: they describe the protocol, they do not speak it."""
    votes = dict.fromkeys([*TEXT_READERS, *STRUCTURAL_DIALECTS], 0)
    start = max(0, len(messages) - DETECT_WINDOW)
    for i in range(start, len(messages)):
        m = messages[i]
        role = m.get("role")
        if i == task or role not in ("assistant", "user") or "ctxgate" in m:  # ctxgate's notes speak no protocol
            continue
        if m.get("tool_calls"):
            votes["tool_calls"] += 1
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result")
                                             for b in content):
            votes["anthropic_blocks"] += 1
        text = text_of(m)
        for name, reader in TEXT_READERS.items():
            if text and reader.signals(text, str(role)):
                votes[name] += 1
                break
    best = max(TEXT_READERS, key=lambda name: votes[name])  # max keeps the first of equals: precedence
    structural = max(STRUCTURAL_DIALECTS, key=lambda name: votes[name])
    if votes[best] > votes[structural]:
        return best
    return structural if votes[structural] else PLAIN
