"""The pipeline's vocabulary: a message, the levels, the recent window, and what a level
returns (`CompressionResult`). It imports nothing of the pipeline, so every module can use
it; the request a level works on is in `request.py`."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

Message = dict[str, Any]
Reason = Literal["proactive", "reactive", "degrade", "client"]
"""`client`: asked for by the client through a provider's context-management API (docs/native-context.md)."""


class Level(str, Enum):
    SNIP = "snip"
    MICROCOMPACT = "microcompact"
    COLLAPSE = "collapse"
    AUTOCOMPACT = "autocompact"


@dataclass(frozen=True)
class RecentWindow:
    """What every level leaves byte-identical: the newest `messages` messages, and never
    fewer than the last `steps` complete steps (an action with its observation)."""
    messages: int = 10
    steps: int = 2


@dataclass(frozen=True)
class CompactionStep:
    """One level's work: what the headers report and the WAL records."""
    level: Level
    span: tuple[int, int]
    """Half-open range of the level's input messages it replaced or changed."""
    tokens_before: int
    tokens_after: int
    duration_ms: float
    messages_affected: int = 0


@dataclass
class CompressionResult:
    compressed_messages: list[Message]
    tokens_freed: int
    level_used: Level | None
    recovery_hints: list[str] = field(default_factory=list)
    steps: list[CompactionStep] = field(default_factory=list)
    tokens_after: int = 0
    fits: bool = True
