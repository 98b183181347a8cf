"""The pipeline's interface: a CompressionRequest in, a CompressionResult (`types.py`) out.
The pipeline never mutates the caller's messages."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from .conversation import Conversation, Shape, read_conversation
from .refs import CutLog
from .tokens import TokenCounter
from .types import Message, Reason, RecentWindow


@dataclass(frozen=True)
class CompressionRequest:
    messages: list[Message]
    token_budget: int
    """What the compressed messages may count at most (tools schema already deducted)."""
    counter: TokenCounter
    reason: Reason = "proactive"
    dialect: str | None = None
    """The protocol the session's agent speaks (`protocols.detect_dialect`); None: detect it."""
    window: RecentWindow = RecentWindow()
    cuts: CutLog | None = None
    """Where the levels keep what they cut, each note naming it `ref ctx:HEX`; None: notes
    without references (expansion off)."""
    anchored: bool = False
    """Earlier compactions' notes right after the instructions and the task stay byte-identical:
    every level works after them, so the prefix up to the last note stays cached
    (docs/compaction.md, incremental compaction). False: they are part of what may be merged."""
    keep: frozenset[str] = frozenset()
    """Fingerprints of messages every level keeps verbatim, like the task statement: the text the
    agent's edit format must match (`tail.kept_for_edits`)."""
    steps_before: int = 0
    """The highest step number that notes taken out of `messages` named (a fallback that sheds
    the notes before it cuts the oldest turns): a note made then numbers its steps on from it,
    not from 1 again (`Conversation.steps_before`)."""
    steps_named: frozenset[int] = frozenset()
    """The step numbers those notes named, where they are known (`Conversation.steps_named`)."""
    task: str | None = None
    """The fingerprint of the client's task statement, as the client's own messages place it
    (`planner._client_task`): the levels read that message as the task wherever the view puts it
    (`conversation.client_task_index`)."""

    @cached_property
    def conversation(self) -> Conversation:
        """The messages as the conversation model reads them (read once per request)."""
        return read_conversation(self.messages, self.dialect, steps_before=self.steps_before,
                                 steps_named=self.steps_named, task=self.task)

    def shape(self, pin_first_user: bool) -> Shape:
        """Where the levels may work on these messages (`Conversation.shape`)."""
        return self.conversation.shape(pin_first_user, self.window, self.anchored, self.keep)

    def with_messages(self, messages: list[Message], token_budget: int | None = None) -> "CompressionRequest":
        """The same request settings over other messages."""
        return replace(self, messages=messages,
                       token_budget=self.token_budget if token_budget is None else token_budget)
