"""The pipeline's interface, as the spec gives it: a CompressionRequest in, a
CompressionResult out. The pipeline never mutates the caller's messages."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .tokens import TokenCounter

Message = dict[str, Any]
Reason = Literal["proactive", "reactive", "degrade"]


class Level(str, Enum):
    SNIP = "snip"
    MICROCOMPACT = "microcompact"
    COLLAPSE = "collapse"
    AUTOCOMPACT = "autocompact"


@dataclass(frozen=True)
class CompressionRequest:
    messages: list[Message]
    token_budget: int
    """What the compressed messages may count at most (tools schema already deducted)."""
    counter: "TokenCounter"
    reason: Reason = "proactive"


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
