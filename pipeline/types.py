"""The pipeline's interface: a CompressionRequest in, a
CompressionResult out. The pipeline never mutates the caller's messages."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .conversation import Conversation, Shape
    from .refs import CutLog
    from .tokens import TokenCounter

Message = dict[str, Any]
Reason = Literal["proactive", "reactive", "degrade"]


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
class CompressionRequest:
    messages: list[Message]
    token_budget: int
    """What the compressed messages may count at most (tools schema already deducted)."""
    counter: "TokenCounter"
    reason: Reason = "proactive"
    dialect: str | None = None
    """The protocol the session's agent speaks (`protocols.detect_dialect`); None: detect it."""
    window: RecentWindow = RecentWindow()
    cuts: "CutLog | None" = None
    """Where the levels keep what they cut, each note naming it `ref ctx:HEX`; None: notes
    without references (expansion off)."""
    anchored: bool = False
    """Earlier compactions' notes right after the instructions and the task stay byte-identical:
    every level works after them, so the prefix up to the last note stays cached
    (docs/compaction.md, incremental compaction). False: they are part of what may be merged."""

    @cached_property
    def conversation(self) -> "Conversation":
        """The messages as the conversation model reads them (read once per request)."""
        from .conversation import read_conversation  # the model reads notes and turns, which use these types
        return read_conversation(self.messages, self.dialect)

    def shape(self, pin_first_user: bool) -> "Shape":
        """Where the levels may work on these messages (`Conversation.shape`)."""
        return self.conversation.shape(pin_first_user, self.window, self.anchored)

    def with_messages(self, messages: list[Message], token_budget: int | None = None) -> "CompressionRequest":
        """The same request settings over other messages."""
        return replace(self, messages=messages,
                       token_budget=self.token_budget if token_budget is None else token_budget)


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
