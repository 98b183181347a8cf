"""One request as compaction sees it (`Turn`) and the budget it is measured against: the
context limit in the provider's tokens, kept in ctxgate's units by the calibration each
reply's usage measures (the engine measures it; `count_offset`, `count_scale`)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Awaitable, Callable

from .config import PipelineConfig
from .fingerprint import prefix_hashes
from .history_index import HistoryIndex
from .policy import CONSERVATIVE_PRICES, Prices
from .protocols import PLAIN
from .tokens import TokenCounter
from .turns import leading_instructions, task_index

Summarize = Callable[[list[dict[str, Any]]], Awaitable[str]]


@dataclass
class Turn:
    """One request as compaction sees it."""
    messages: list[dict[str, Any]]
    fingerprints: list[str]
    tools: list[dict[str, Any]] | None
    counter: TokenCounter
    config: PipelineConfig
    max_input_tokens: int
    summarize: Summarize
    reserved_tokens: int = 0
    """Forwarded besides the client's messages and tools (the memory block): kept out of the room compaction has."""
    dialect: str = PLAIN
    """The protocol the session's agent speaks, as detected and remembered (`SessionState.dialect`)."""
    count_offset: int = 0
    """The provider's count minus ctxgate's, measured on this session's last reply
    (`usage.prompt_tokens`, see `provider_offset`): budget decisions are made in the tokens
    the provider enforces its limit in. Counts reported to the client stay ctxgate's."""
    count_scale: float = 1.0
    """The provider's count over ctxgate's, for a counter that only estimates (`calibration_of`):
    the limit is divided by it, so budget decisions are made in ctxgate's own units."""

    prices: Prices = CONSERVATIVE_PRICES
    """The route's prices, for the compaction cost model (`depth.prices_of`)."""

    index: HistoryIndex | None = None
    """The messages' fingerprints, prefix hashes and counts, when the engine built them
    (extending the session's last turn's); None: computed here when asked."""

    @cached_property
    def prefix_hashes(self) -> list[str]:
        """`[i]` names the client's first i + 1 messages; computed once per turn for every user."""
        if self._indexed():
            assert self.index is not None
            return self.index.prefix_hashes
        return prefix_hashes(self.fingerprints)

    def message_tokens(self, start: int = 0) -> int:
        """ctxgate's count of the client's messages from `start` on (`TokenCounter.count_messages`)."""
        if self._indexed():
            assert self.index is not None
            return self.index.tokens(start)
        return self.counter.count_messages(self.messages[start:], self.fingerprints[start:])

    def _indexed(self) -> bool:
        return (self.index is not None and len(self.index) == len(self.messages)
                and self.index.counter_name == self.counter.name and self.index.is_counted)

    def tokens_in(self) -> int:
        """ctxgate's count of what the client sent: its messages and the tools schema."""
        return self.message_tokens() + self.counter.count_tools(self.tools)

    def fixed_tokens(self) -> int:
        return self.counter.count_tools(self.tools) + self.reserved_tokens

    def outside_tokens(self) -> int:
        """What the provider counts besides the client's messages as ctxgate counts them."""
        return self.fixed_tokens() + self.count_offset

    @cached_property
    def pinned_tokens(self) -> int:
        """What no level removes: the leading instructions and the task statement."""
        keep = leading_instructions(self.messages)
        task = task_index(self.messages)
        pinned = self.messages[:keep] + ([self.messages[task]] if task is not None and task >= keep else [])
        return self.counter.count_messages(pinned)

    def target(self, budget: int, ratio: float) -> int:
        """Where a compaction lands, in ctxgate's count of the messages. `ratio` of the budget
        when what nothing can remove (the tools schema, the memory block, the instructions
        and the task) is small; when it is large, that fixed part plus the same share of the
        room it leaves below the trigger, so the history still has room to grow before the
        next compaction rather than a target no compaction can reach."""
        fixed = self.pinned_tokens + self.outside_tokens()
        trigger = self.config.trigger_ratio * budget
        share = ratio / self.config.trigger_ratio
        return int(max(ratio * budget, fixed + share * max(0.0, trigger - fixed))) - self.outside_tokens()


def context_limit(turn: Turn, learned: int | None) -> int:
    """The context limit: the model's (or `X-Ctx-Budget`), or a smaller one the upstream
    reported (`learned`); in ctxgate's units (`Turn.count_scale`)."""
    limit = turn.max_input_tokens
    if learned:
        limit = min(limit, learned)
    return int(limit / turn.count_scale)


def effective_budget(turn: Turn, learned: int | None) -> int:
    return turn.config.effective_budget(context_limit(turn, learned))
