"""What the engine plans to forward (`Plan`), the budget of a session's turn (`budget_of`:
the planner's `effective_budget` with what the session learned), and the calibration each
reply's usage measures. `Turn` is the planner's (`ctxgate.pipeline.budget`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxgate.pipeline.budget import Summarize as Summarize, Turn as Turn, context_limit, effective_budget
from ctxgate.pipeline.fingerprint import tools_fingerprint
from .state import SessionState


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
    return context_limit(turn, state.learned_max_input_tokens)


def budget_of(state: SessionState, turn: Turn) -> int:
    return effective_budget(turn, state.learned_max_input_tokens)


def watermark(turn: Turn, state: SessionState) -> float:
    """Where a session may start compacting (a speculation starts, or the trigger)."""
    return turn.config.watermark_ratio() * budget_of(state, turn)
