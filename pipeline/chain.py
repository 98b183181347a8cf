"""CompressionPipeline: the four levels as a chain of strategies, then activeRestore.

`compact()` tries each strategy in order, each on the previous one's output, and stops at
the first result that fits the target; there is no dispatch on levels. Strategies are
registered by name in `STRATEGIES`, so a profile's `levels:` list is the chain.
"""
from __future__ import annotations

from typing import Any, Callable

from .autocompact import AutocompactBreaker, AutocompactStrategy, Summarize
from .collapse import CollapseStore, CollapseStrategy
from .config import PipelineConfig
from .microcompact import MicrocompactStrategy, RecentWindowCut
from .notes import is_compaction_note, is_restore_block, notice_message, notice_tokens
from .restore import ActiveRestore, WorkingState
from .snip import SnipStrategy
from .strategy import Strategy
from .turns import leading_instructions, task_index
from .request import CompressionRequest
from .types import CompressionResult, Message


class PipelineParts:
    """What a strategy may need besides its own settings."""

    def __init__(self, config: PipelineConfig, collapse_store: CollapseStore, breaker: AutocompactBreaker,
                 summarize: Summarize | None, effective_budget: int,
                 precomputed: dict[str, dict[str, Any]] | None) -> None:
        self.config = config
        self.collapse_store = collapse_store
        self.breaker = breaker
        self.summarize = summarize
        self.effective_budget = effective_budget
        self.precomputed = precomputed


STRATEGIES: dict[str, Callable[[PipelineParts], Strategy]] = {
    "snip": lambda p: SnipStrategy(p.config.snip, p.config.pin_first_user),
    "microcompact": lambda p: MicrocompactStrategy(p.config.microcompact, p.config.pin_first_user,
                                                   p.effective_budget),
    "collapse": lambda p: CollapseStrategy(p.config.collapse, p.collapse_store, p.config.pin_first_user),
    "autocompact": lambda p: AutocompactStrategy(p.config.autocompact, p.summarize, p.breaker,
                                                 p.config.pin_first_user, p.precomputed),
}


def restore_position(messages: list[Message], pin_first_user: bool) -> int:
    """Right after the leading instructions, the pinned task and the compaction notes that
    follow them: the restore blocks change at every compaction point, the notes before them
    do not, so the prefix up to the newest note stays cached."""
    at = leading_instructions(messages)
    if pin_first_user and at < len(messages) and task_index(messages) == at:
        at += 1
    while at < len(messages) and is_compaction_note(messages[at]):
        at += 1
    return at


class CompressionPipeline:
    def __init__(self, strategies: list[Strategy], restore: ActiveRestore | None = None,
                 restore_budget: int = 0, pin_first_user: bool = True, last_resort: Strategy | None = None) -> None:
        self.strategies = strategies
        self.last_resort = last_resort
        """Run once when every strategy has and the result still does not fit."""
        self.restore = restore
        self.restore_budget = restore_budget
        self.pin_first_user = pin_first_user

    async def compact(self, request: CompressionRequest) -> CompressionResult:
        counter = request.counter
        # Restore blocks are regenerated at every compaction, never stacked. The state lists
        # (tasks, plan, last error, skill, file names) are reserved up front; file contents
        # only take what the compacted request leaves (below), never room from kept messages.
        given = request.messages
        messages = [m for m in given if not is_restore_block(m)]
        request = request.with_messages(messages) if len(messages) != len(given) else request
        # The notice that comes with quoted notes is reserved too (the result is counted with it).
        notice = counter.count_structured(notice_message())
        target = max(1, request.token_budget - self.reserve(request) - notice)
        steps, hints = [], []
        current = messages
        fits = counter.count_messages(current) <= target
        for strategy in self.strategies:
            if fits:
                break
            result = await strategy.compress(request.with_messages(current, target))
            if result is None:
                continue
            hints += result.recovery_hints
            # A level whose note outweighs what it removed (a few tiny messages) is not applied.
            if result.steps and result.tokens_after < result.steps[0].tokens_before:
                current = result.compressed_messages
                steps += result.steps
            fits = result.fits
        if not fits and self.last_resort is not None:
            # The window is cut only when it is over the target itself: not to make room for the
            # restore lists reserved from it (they may take the point a little past its target).
            result = await self.last_resort.compress(request.with_messages(current, request.token_budget))
            if result is not None:
                current, steps, hints = result.compressed_messages, steps + result.steps, hints + result.recovery_hints
        if steps:
            # Recompute against what is kept, so a file still on show is not restored twice,
            # and give file contents only the room the compacted request and the lists leave.
            room = max(0, request.token_budget - counter.count_messages(current) - notice)
            blocks = self._restore_blocks(current, request, visible=current, room=room,
                                          cuts=request.cuts.originals if request.cuts is not None else None)
            at = restore_position(current, self.pin_first_user)
            current = current[:at] + blocks + current[at:]
        elif len(messages) != len(given):
            # No level changed anything (a point that only folds earlier notes): the restored
            # state stays as it was, not dropped with nothing in its place.
            current = given
        after = counter.count_messages(current) + notice_tokens(counter, current)  # as forwarded
        before = counter.count_messages(request.messages)
        level = steps[-1].level if steps else None
        return CompressionResult(compressed_messages=current, tokens_freed=max(0, before - after), level_used=level,
                                 recovery_hints=hints, steps=steps, tokens_after=after,
                                 fits=after <= request.token_budget)

    def reserve(self, request: CompressionRequest) -> int:
        """What the restore blocks' state lists take: reserved from the target before the levels run."""
        messages = [m for m in request.messages if not is_restore_block(m)]
        blocks = self._restore_blocks(messages, request, room=0)
        return sum(request.counter.count_structured(b) for b in blocks)

    def _restore_blocks(self, messages: list[Message], request: CompressionRequest,
                        visible: list[Message] | None = None, room: int | None = None,
                        cuts: dict[str, str] | None = None) -> list[Message]:
        if self.restore is None or self.restore.state.is_empty():
            return []
        kept = [m for m in visible or [] if not is_compaction_note(m)]
        return self.restore.blocks(request.counter, self.restore_budget, kept or None, room, cuts)


def build_pipeline(config: PipelineConfig, *, collapse_store: CollapseStore | None = None,
                   breaker: AutocompactBreaker | None = None, summarize: Summarize | None = None,
                   working_state: WorkingState | None = None, effective_budget: int = 0,
                   precomputed: dict[str, dict[str, Any]] | None = None) -> CompressionPipeline:
    parts = PipelineParts(config, collapse_store or CollapseStore(config.collapse),
                          breaker or AutocompactBreaker(max_failures=config.autocompact.max_failures),
                          summarize, effective_budget, precomputed)
    strategies = [STRATEGIES[name](parts) for name in config.levels]
    restore = ActiveRestore(config.restore, working_state) if working_state is not None else None
    microcompact = next((s for s in strategies if isinstance(s, MicrocompactStrategy)), None)
    return CompressionPipeline(strategies, restore, int(effective_budget * config.restore.budget_ratio),
                               config.pin_first_user, RecentWindowCut(microcompact) if microcompact else None)
