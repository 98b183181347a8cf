"""How deep one compaction point goes: the cost model (`pipeline/policy.py`) fed with what
the session shows now — its fixed part, its earlier notes, its recent window, its growth
per turn — and the route's prices (docs/compaction.md, the cost model)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import PipelineConfig
from .conversation import Conversation, read_conversation
from .notes import is_summary_note
from .policy import CONSERVATIVE_PRICES, Choice, Outlook, Prices, choose_target
from .tokens import REPLY_PRIMING
from .request import CompressionRequest
from .tail import PROTECTED_TAIL
from .types import RecentWindow
from .budget import Turn

GROWTH_TURNS = 10
"""The session's growth per turn is measured over its newest this-many agent turns."""
NOTE_MARGIN = 100
"""Autocompact's recovery message around the summary (its quote, source and fixed wording)."""


@dataclass(frozen=True)
class Depth:
    target: int
    """Where the chain lands, in ctxgate's count of the messages."""
    window: RecentWindow
    """What it keeps verbatim at the end."""
    anchored: bool = False
    """The earlier notes stay byte-identical (`anchored`)."""
    choice: Choice | None = None
    """The cost model's verdict (None with `cost.depth: target`, or with no room for a choice)."""
    narrowed: bool = False
    """No room for a choice even with the newest step alone: the window is that step, and the
    chain tries the cheap levels first (`planner.plan`)."""

    def log_fields(self) -> dict[str, Any]:
        """What the compaction log says of the decision."""
        if self.choice is None and not self.narrowed:
            return {}
        fields: dict[str, Any] = {"target": self.target, "window": [self.window.messages, self.window.steps]}
        if self.choice is not None:
            fields["turns_expected"] = round(self.choice.turns, 1)
        return fields


def prices_of(config: PipelineConfig, route_prices: Prices | None) -> Prices:
    """The profile's or tenant's prices when set, else the route's, else conservative ones."""
    if config.cost.prices is not None:
        p = config.cost.prices
        return Prices(input=p.input, cache_read=p.cache_read, cache_write=p.cache_write, output=p.output,
                      model="configured")
    return route_prices or CONSERVATIVE_PRICES


def growth_per_turn(turn: Turn) -> float:
    """Tokens the client's history grew by per agent turn, over its newest `GROWTH_TURNS` turns:
    read from the request itself, so a session rebuilt from its log decides as the live one."""
    turns = [i for i, m in enumerate(turn.messages) if m.get("role") == "assistant"][-GROWTH_TURNS:]
    if not turns:
        return float(max(1, turn.message_tokens()))
    return max(1.0, turn.message_tokens(turns[0]) / len(turns))


def anchored(turn: Turn, conversation: Conversation, budget: int) -> bool:
    """Whether the earlier compaction notes stay byte-identical through this compaction point
    (incremental compaction): yes, unless together they are over `notes_cap_ratio` of the room
    between what no level removes and the trigger; then this point merges them."""
    cfg = turn.config
    start, end = conversation.anchor(cfg.pin_first_user)
    if not cfg.incremental or end == start:
        return False
    counts = conversation.counts(turn.counter)
    room = cfg.trigger_ratio * budget - turn.outside_tokens() - sum(counts[:start])
    return sum(counts[start:end]) <= cfg.notes_cap_ratio * max(0.0, room)


def plan_depth(turn: Turn, view: list[dict[str, Any]], budget: int, restore: int) -> Depth:
    """The target and recent window of a proactive compaction of `view`; `restore`: what the
    restore blocks' state lists will take. The cost model chooses between the floor (what the
    agent must keep, the earlier notes included) and the profile's target. When the configured
    window leaves no room between them (a large system prompt and tools under a small limit),
    the window narrows to the newest complete steps that do, down to the newest one, and the
    cost model chooses with it; when even the newest step leaves none, the point is `narrowed`
    (`planner.plan`: the older window's observations are cut once, deeply, if that frees enough)."""
    cfg = turn.config
    conversation = read_conversation(view, turn.dialect)
    counts = conversation.counts(turn.counter)
    # A point frees at least `clear_at_least`: a cache break must buy room, not a few tokens.
    profile = turn.target(budget, cfg.target_ratio)
    default = min(profile, REPLY_PRIMING + sum(counts) - cfg.cost.least_gain(budget))
    keep_notes = anchored(turn, conversation, budget)
    if cfg.cost.depth == "target":
        return Depth(default, cfg.window(), keep_notes)
    start, end = conversation.anchor(cfg.pin_first_user)
    stable = REPLY_PRIMING + sum(counts[:end if keep_notes else start])
    trigger = int(cfg.trigger_ratio * budget) - turn.outside_tokens()
    allowance = summary_allowance(cfg, budget, conversation, counts)
    reserve = allowance + NOTE_MARGIN + restore
    growth = growth_per_turn(turn)

    def floor_with(window: RecentWindow) -> int:
        return stable + reserve + sum(counts[max(end, conversation.recent_start(window)):])

    tail_start = max(end, conversation.recent_start(_tail(cfg)))
    # The protected tail is held while what lies before it can give room: the older messages
    # free the least gain, and the tail with what no level removes stays under the trigger.
    # Held where nothing older is worth a cut, the point would cut nothing, and again next turn.
    older = sum(counts[end if keep_notes else start:tail_start])
    hold_tail = older >= cfg.cost.least_gain(budget) and floor_with(_tail(cfg)) - reserve < trigger
    # The configured window, unless keeping it whole leaves room for fewer than
    # `cost.min_turns` turns of growth: then the newest complete steps that do (at least one).
    windows = _windows(cfg, hold_tail)
    window = next((w for w in windows if trigger - floor_with(w) >= cfg.cost.min_turns * growth), windows[-1])
    if floor_with(window) >= profile:  # the window leaves no room at the profile's target
        narrower = windows[windows.index(window):]
        window = next((w for w in narrower if floor_with(w) < default), windows[-1])
    floor = floor_with(window)
    if floor >= default:
        return Depth(default, window, keep_notes, narrowed=window != cfg.window())
    outlook = Outlook(trigger=trigger, stable=stable, floor=floor, default=default, growth=growth,
                      view=REPLY_PRIMING + sum(counts), summary_tokens=allowance)
    choice = choose_target(outlook, turn.prices)
    return Depth(choice.target, window, keep_notes, choice)


def summary_allowance(cfg: PipelineConfig, budget: int, conversation: Conversation, counts: list[int]) -> int:
    """What this point's summary is expected to write: Autocompact's allowance, or less once the
    session shows what its summariser writes (its newest summary note, with a quarter's margin):
    a floor that reserves a full allowance for a short summary leaves the point less room than
    it has, and then the recent window narrows for nothing."""
    allowance = min(cfg.autocompact.summary_max_tokens, max(100, budget // 8))
    start, end = conversation.anchor(cfg.pin_first_user)
    seen = [counts[i] - NOTE_MARGIN for i in range(start, end) if is_summary_note(conversation.messages[i])]
    return allowance if not seen else min(allowance, max(100, int(seen[-1] * 1.25)))


def merge_due(turn: Turn, request: CompressionRequest) -> bool:
    """The earlier notes are over their cap (the request is not anchored, incremental
    compaction on): this point merges them."""
    start, end = request.conversation.anchor(turn.config.pin_first_user)
    return turn.config.incremental and not request.anchored and end > start


def chain_config(config: PipelineConfig, window: RecentWindow, merge: bool) -> PipelineConfig:
    """The settings the chain runs with at this point: `with_window`, and when the earlier notes
    are due to be merged, without Snip (which keeps notes as they are) when Autocompact, which
    summarises them with the new span, is on."""
    config = with_window(config, window)
    if merge and "autocompact" in config.levels and "snip" in config.levels:
        config = config.model_copy(update={"levels": [lv for lv in config.levels if lv != "snip"]})
    return config


def with_window(config: PipelineConfig, window: RecentWindow) -> PipelineConfig:
    """`config` for a compaction that keeps `window`: a window narrower than the configured one
    narrows Snip's `keep_recent` with it, so the older window can be cut."""
    if window == config.window() or config.snip.keep_recent <= window.messages:
        return config
    return config.model_copy(update={"snip": config.snip.model_copy(update={"keep_recent": window.messages})})


def _tail(cfg: PipelineConfig) -> RecentWindow:
    """The protected tail (`tail.PROTECTED_TAIL`), or the configured window when that is narrower."""
    return RecentWindow(messages=min(PROTECTED_TAIL.messages, cfg.recent_messages), steps=1)


def _windows(cfg: PipelineConfig, hold_tail: bool) -> list[RecentWindow]:
    """The recent windows a point may keep, widest first: the configured one, then the newest
    `recent_steps` complete steps down to the newest one, never fewer than the protected
    tail's messages while it is held (`hold_tail`): older observations, the notes and the
    restored state give room first. It is not held where it and what no level removes already
    pass the trigger, nor where nothing older frees the least gain: kept there, every turn
    would be a point, each landing where the last did."""
    least = _tail(cfg).messages if hold_tail else 1
    return [cfg.window()] + [RecentWindow(messages=least, steps=k) for k in range(max(1, cfg.recent_steps), 0, -1)]
