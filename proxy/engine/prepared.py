"""A turn as a door hands it to the engine (`TurnInput`, in the neutral conversation
model) and as the engine planned it, ready to forward (`PreparedTurn`): what `TurnEngine`
reads and what the doors settle and finish by."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ..tenancy import Caller
from ..upstream.routing import Route
from .expansion import Expansion
from .history import KnownPrefix
from .memory_turn import MemoryScope, forwarded
from .quiet import QUIET
from .turn_budget import Plan, Turn
from .wire import upstream_key


@dataclass
class TurnInput:
    """One request of any door, in the neutral conversation model."""
    messages: list[dict[str, Any]]
    """The conversation as the pipeline reads it: instructions first, as system messages."""
    tools: list[dict[str, Any]] | None
    stream: bool
    memory_scope: MemoryScope | None = None
    """Whose long-term memory the turn reads and feeds; None when memory is off."""
    known: KnownPrefix | None = None
    """What the door found of the session's last request (`HistoryCache.match`); None: the engine looks."""
    body_bytes: int = 0
    """The request body's size: what the history cache weighs it at."""
    door_state: Any = None
    """The door's own reading of the request, kept with the session's history for its next turn."""
    count_bound: int | None = None
    """At least what a byte-bounded tokenizer counts for the messages and tools
    (`tokens.json_bound` of the body), when the body holds all of them; else None."""
    fresh_bytes: int | None = None
    """The body's bytes past what the session's last request had (its tail, `ResentBodies`):
    the work of a steady turn; None: as many as `body_bytes`."""
    keep: Callable[[], None] | None = None
    """The door's keeping of the checked body for the session's next (`ResentBodies.keep`):
    work for a later request, done once this one's is on its way (a new 107K conversation's
    scans ~0.4 ms), or once a preview is counted."""

    def kept(self) -> None:
        """Run `keep`, once."""
        keep, self.keep = self.keep, None
        if keep is not None:
            keep()


@dataclass
class PreparedTurn:
    """A turn planned and logged, ready to forward; what its end needs to know."""
    caller: Caller
    session_id: str
    route: Route
    turn: Turn
    offset_key: str
    """What a count offset measured on this reply holds for (`count_offset_key`)."""
    plan: Plan
    memory_block: str
    guard_set: bool
    started: float
    headers: dict[str, str]
    levels: list[str] = field(default_factory=list)
    upstream_ms: float = 0.0
    counting: "asyncio.Task[None] | None" = None
    """A new conversation far below the trigger is counted beside the upstream call: this
    counts it, logs the turn's messages and fills the plan's count (`count_beside.py`)."""
    expansion: Expansion | None = None
    """The expansion tool is offered (the session was compacted, expansion is on, the door has tools)."""
    payload: dict[str, Any] | None = None
    """The body last sent upstream: what an expansion's follow-up appends to."""
    capture: "Callable[[], None] | None" = None
    """Memory's capture of the turn's messages, started once the reply is in the client's
    hands (`finish`) or the upstream call failed (`captured`): work done for later turns never
    competes with this one's reply. A turn that ends neither way is captured with the session's next."""
    checkpoint: "Callable[[], None] | None" = None
    """The periodic CHECKPOINT the settled turn made due (`Sessions.checkpoint_later`), started by `finish`."""
    keep: "Callable[[], Awaitable[None]] | None" = None
    """The door's keeping of the body (`TurnInput.keep`), started once the request is written."""

    def captured(self) -> None:
        """Start memory's capture of the turn, once, when this process counts nothing (`quiet.py`)."""
        capture, self.capture = self.capture, None
        if capture is not None:
            QUIET.after_counts(capture)

    def finish(self) -> None:
        """The reply is written: the work it made due for later turns starts. Started during
        `settle`, a capture's thread and a checkpoint's copy of the state held the GIL while the
        reply was still to be written (1-5 ms of a new 107K conversation's reply)."""
        checkpoint, self.checkpoint = self.checkpoint, None
        if checkpoint is not None:
            checkpoint()
        self.captured()

    def forwarded(self) -> list[dict[str, Any]]:
        """The conversation to forward: the plan's messages with the memory block and ctxgate's notice in."""
        return forwarded(self.plan.messages, self.memory_block, self.route.single_system)

    @property
    def api_key(self) -> str | None:
        """The key this turn's upstream calls go with."""
        return upstream_key(self.caller, self.route)

    def overhead_ms(self) -> float:
        return max(0.0, (time.perf_counter() - self.started) * 1000 - self.upstream_ms)
