"""Which text protocol a conversation speaks, judged from its own messages."""
from __future__ import annotations

from typing import Any

from ..turns import INSTRUCTION_ROLES
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


def instructions_of(messages: list[dict[str, Any]]) -> str:
    """The text of the leading instructions (system and developer messages): where an agent
    says which format it speaks."""
    end = next((i for i, m in enumerate(messages) if m.get("role") not in INSTRUCTION_ROLES), len(messages))
    return "\n".join(text_of(m) for m in messages[:end])


def text_reader(dialect: str, messages: list[dict[str, Any]] | None = None) -> TextReader | None:
    """The reader of a dialect's text turns, as the instructions of `messages` configure it;
    None for a structural dialect, whose text turns are talk (a tool-calling agent's user
    turns are its user's words, not observations)."""
    if dialect in STRUCTURAL_DIALECTS:
        return None
    reader = TEXT_READERS.get(dialect, TEXT_READERS[PLAIN])
    return reader.learn(instructions_of(messages)) if messages else reader


def dialect_votes(messages: list[dict[str, Any]], task: int | None = None) -> dict[str, int]:
    """How many of the recent turns signal each protocol. A turn is evidence for every
    protocol it signals, read as the instructions configure each (mini-swe-agent's fence);
    the task statement and the instructions themselves are not evidence: they describe the
    protocol, they do not speak it."""
    instructions = instructions_of(messages)
    readers = {name: reader.learn(instructions) for name, reader in TEXT_READERS.items()}
    votes = dict.fromkeys([*TEXT_READERS, *STRUCTURAL_DIALECTS], 0)
    for i in range(max(0, len(messages) - DETECT_WINDOW), len(messages)):
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
        for name, reader in readers.items():
            if text and reader.signals(text, str(role)):
                votes[name] += 1
    return votes


def detect_dialect(messages: list[dict[str, Any]], task: int | None = None) -> str:
    """The text protocol most of the recent turns are unmistakably in (`dialect_votes`); else
    the structural one they use (`tool_calls`, `anthropic_blocks`); else `plain`. A tie goes
    to the more specific form."""
    votes = dialect_votes(messages, task)
    best = max(TEXT_READERS, key=lambda name: votes[name])  # max keeps the first of equals
    structural = max(STRUCTURAL_DIALECTS, key=lambda name: votes[name])
    if votes[best] > votes[structural]:
        return best
    return structural if votes[structural] else PLAIN
