"""What a compaction point gives up when the chain's result is still over the budget
(docs/compaction.md, the recent window): each step runs only while the request is over, and
each keeps more of what the agent needs than the next one would."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .chain import CompressionPipeline
from .config import PipelineConfig
from .microcompact import LastObservationCut, MicrocompactStrategy
from .notes import notice_tokens
from .restore import shed_own_messages
from .snip import SnipStrategy
from .tokens import TokenCounter
from .request import CompressionRequest
from .types import CompressionResult, RecentWindow
from .depth import chain_config, with_window


@dataclass
class OverBudget:
    """The fallbacks of one compaction point, with what it runs them with."""
    config: PipelineConfig
    counter: TokenCounter
    pipeline_of: Callable[[PipelineConfig], CompressionPipeline]
    """The chain with this point's stores and its one summary call."""
    summaries: Callable[[], int]
    """Summary calls made so far at this point."""
    hard: int
    """The effective budget left for the messages."""
    limit: int
    """The context limit itself left for the messages (no safety margin)."""

    async def fit(self, request: CompressionRequest, result: CompressionResult
                  ) -> tuple[CompressionRequest, CompressionResult]:
        """`result` brought within the budget as far as the fallbacks go, and the request it
        was last compacted with."""
        cfg, hard = self.config, self.hard
        # What goes before the recent window does: the restored files first, then (when no
        # summary was asked for yet) the earlier notes, merged by this point's one summary.
        result = shed(result, self.counter, hard)
        if (result.tokens_after > hard and request.anchored and not self.summaries()
                and "autocompact" in cfg.levels):
            merging = replace(request, anchored=False)
            merged = shed(await self.pipeline_of(chain_config(cfg, request.window, True)).compact(merging),
                          self.counter, hard)
            if merged.tokens_after < result.tokens_after:
                request, result = merging, merged
        if result.tokens_after <= hard:
            return request, result
        result = await self._turn_in_progress(request, result)
        result = await self._last_observation(request, result)
        # Still over: the rest of the restored state and the notes go too (the instructions take
        # nearly all the room), rather than forward what the provider refuses.
        result = shed(result, self.counter, hard, everything=True)
        return request, await self._oldest_turns(request, result)

    async def _turn_in_progress(self, request: CompressionRequest, result: CompressionResult) -> CompressionResult:
        """The recent window alone, cut as far as Microcompact goes, is over the budget: keeping
        it verbatim would only forward a request the provider refuses. Only the turn in progress
        is kept whole then. A summary asked for already is not asked for again over a wider
        span: the cheap levels go on from what it left, with its note kept."""
        cfg = self.config
        narrow = RecentWindow(messages=1, steps=0)
        again = replace(request, window=narrow)
        config = with_window(cfg, narrow)  # Snip keeps no more than the window either
        if not self.summaries():
            return await self.pipeline_of(config).compact(again)
        config = config.model_copy(update={"levels": [lv for lv in cfg.levels if lv != "autocompact"]})
        again = replace(again, messages=result.compressed_messages, anchored=True)
        return joined(result, await self.pipeline_of(config).compact(again))

    async def _last_observation(self, request: CompressionRequest, result: CompressionResult) -> CompressionResult:
        """Still over: the last message, an observation, is cut head and tail. Towards the target,
        not only to the limit (the turn would land at it and the next turn compact again), but
        keeping what Microcompact keeps of any output: the newest output's head and tail are where
        its failure lines mostly are (measured: cut to the target alone, the last error line was
        in view a tenth less often)."""
        cfg, hard = self.config, self.hard
        if result.tokens_after <= hard or "microcompact" not in cfg.levels:
            return result
        others = result.tokens_after - self.counter.count_structured(result.compressed_messages[-1])
        keep = cfg.microcompact.head_tokens + cfg.microcompact.tail_tokens
        cut = await LastObservationCut(MicrocompactStrategy(cfg.microcompact, cfg.pin_first_user, hard)).compress(
            replace(request, messages=result.compressed_messages,
                    token_budget=min(hard, max(request.token_budget, others + keep))))
        return result if cut is None else joined(result, self._as_forwarded(cut))

    async def _oldest_turns(self, request: CompressionRequest, result: CompressionResult) -> CompressionResult:
        """Still over, in a conversation too short or with turns too small for Snip's minimums
        (blocks of 5 in 10 messages): the oldest turns after the task go, under a note that only
        counts them, down to the last message; then what ctxgate added, up to the context limit
        itself rather than the budget's safety margin. Forwarding what the provider refuses
        would cost the turn."""
        cfg = self.config
        if result.tokens_after <= self.hard or "snip" not in cfg.levels:
            return result
        last = SnipStrategy(cfg.snip.model_copy(update={"keep_recent": 1, "min_block": 1, "min_messages": 1,
                                                        "preview_chars": 0}), cfg.pin_first_user)
        cut = await last.compress(replace(request, messages=result.compressed_messages, token_budget=self.hard,
                                          window=RecentWindow(messages=1, steps=0), anchored=True))
        if cut is not None:
            cut = self._as_forwarded(cut)
            if cut.tokens_after < result.tokens_after:
                result = joined(result, cut)
        return shed(result, self.counter, self.limit, everything=True)


    def _as_forwarded(self, result: CompressionResult) -> CompressionResult:
        """A level's result counted as the chain counts its own: with the notice its quoted notes bring."""
        return replace(result, tokens_after=result.tokens_after + notice_tokens(self.counter,
                                                                                result.compressed_messages))


def joined(first: CompressionResult, then: CompressionResult) -> CompressionResult:
    """`then`, which went on from `first`'s messages, with `first`'s steps and hints before its own."""
    return replace(then, steps=first.steps + then.steps, recovery_hints=first.recovery_hints + then.recovery_hints)


def shed(result: CompressionResult, counter: TokenCounter, limit: int, everything: bool = False) -> CompressionResult:
    """`result` without those of ctxgate's own messages it cannot afford under `limit`
    (`shed_own_messages`); as it is if it fits, or does not fit even without them."""
    if result.tokens_after <= limit:
        return result
    shed_messages = shed_own_messages(result.compressed_messages, counter, limit, everything)
    if shed_messages is None:
        return result
    return replace(result, compressed_messages=shed_messages,
                   tokens_after=counter.count_messages(shed_messages) + notice_tokens(counter, shed_messages))
