"""One request as the compactor sees it (`Turn`), what it plans to forward (`Plan`), and
the budget it is measured against: the context limit in the provider's tokens, kept in
ctxgate's units by the calibration each reply's usage measures."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Awaitable, Callable

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.fingerprint import prefix_hashes, tools_fingerprint
from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.policy import CONSERVATIVE_PRICES, Prices
from ctxgate.pipeline.protocols import PLAIN
from ctxgate.pipeline.tokens import TokenCounter
from ctxgate.pipeline.turns import leading_instructions, task_index
from .state import SessionState

Summarize = Callable[[list[dict[str, Any]]], Awaitable[str]]


@dataclass
class Turn:
    """One request as the compactor sees it."""
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


@dataclass
class Plan:
    """What to forward, and what was done to get it."""
    messages: list[dict[str, Any]]
    tokens_out: int | None
    """ctxgate's count of what is forwarded; None until a turn counted beside its upstream call is."""
    levels: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    degraded: bool = False
    """Made in the degraded mode (the loop guard was set): a refusal of it ends the turn."""

    def counted_tokens(self) -> int:
        """`tokens_out`, of a plan whose turn is counted (every plan but a late-counted turn's, until it is)."""
        assert self.tokens_out is not None, "a late-counted turn is counted before its plan's count is read"
        return self.tokens_out


def provider_offset(reported: int, counted: int, tools_tokens: int) -> int:
    """How many tokens more (or fewer) the provider counted than ctxgate for one request.
    Providers differ in what they count (a scripted or self-hosted upstream may leave the
    tools schema out, a provider's framing differs from the published formula, an estimate
    is only an estimate): their own figure is the one their limit applies to. Bounded, so a
    provider reporting nonsense cannot make ctxgate forward far more than it counts: at
    most the tools schema and 5% fewer, at most 50% more."""
    return max(-(tools_tokens + counted // 20), min(counted // 2, reported - counted))


MIN_SCALE, MAX_SCALE = 0.5, 1.5
"""How far the provider's count may scale ctxgate's estimate (bytes / 3 runs high on plain
English, near bytes / 4.5, and low on dense non-Latin text)."""


def calibration_of(turn: Turn, counted: int, reported: int) -> tuple[int, float]:
    """(count offset, count scale) once the provider counted `reported` tokens for what
    ctxgate counted `counted`. A tokenizer's error is a fixed amount (framing, the tools
    schema): an offset. The bytes / 3 estimate's error grows with the text: a scale, so a
    measurement on the whole history still holds for the much smaller compacted view."""
    if turn.counter.exact:
        return provider_offset(reported, counted, turn.counter.count_tools(turn.tools)), 1.0
    return 0, min(MAX_SCALE, max(MIN_SCALE, reported / max(1, counted)))


def measured_calibration(turn: Turn, tokens_out: int, reported: int) -> tuple[int, float] | None:
    """The calibration to keep once the provider counted `reported` tokens for a request
    ctxgate counted `tokens_out`; None when it is the one in use, give or take (small
    variations would only move the compaction points from turn to turn)."""
    if reported <= 0:
        return None
    offset, scale = calibration_of(turn, tokens_out, reported)
    if abs(offset - turn.count_offset) <= max(8, tokens_out // 200) and abs(scale - turn.count_scale) <= 0.01:
        return None
    return offset, scale


def count_offset_key(model: str, tools: list[dict[str, Any]] | None) -> str:
    """What a measured count offset holds for: the same model and the same tools schema."""
    return f"{model}:{tools_fingerprint(tools)}"


def limit_of(state: SessionState, turn: Turn) -> int:
    """The context limit: the model's (or `X-Ctx-Budget`), or a smaller one the upstream
    reported; in ctxgate's units (`Turn.count_scale`)."""
    limit = turn.max_input_tokens
    if state.learned_max_input_tokens:
        limit = min(limit, state.learned_max_input_tokens)
    return int(limit / turn.count_scale)


def budget_of(state: SessionState, turn: Turn) -> int:
    return turn.config.effective_budget(limit_of(state, turn))
