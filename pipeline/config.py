"""Typed settings of the pipeline, with the three profiles' defaults (docs/compaction.md)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .conversation import PLAN_TOOLS, TODO_TOOLS
from .types import RecentWindow


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SnipConfig(_Strict):
    keep_recent: int = 10
    """Snip never cuts into the newest this-many messages (nor into the recent window)."""
    min_block: int = 5
    """Cut nothing smaller than this many messages (N < 5 -> no Snip)."""
    min_messages: int = 10
    """Leave conversations shorter than this alone (fewer than 10 -> no Snip)."""
    preview_chars: int = Field(default=80, ge=0)
    """Each cut message's preview in the note (0: the note only counts them)."""


class MicrocompactConfig(_Strict):
    default_threshold: int = 4000
    head_tokens: int = 1500
    tail_tokens: int = 500
    thresholds: dict[str, int] = Field(default_factory=lambda: {
        "read_file": 8000, "view": 8000, "str_replace_editor": 8000, "cat": 8000, "open": 8000,
        "bash": 2000, "execute_bash": 2000, "shell": 2000, "run": 2000, "terminal": 2000,
    })
    """Per-tool thresholds by tool name; a name matches
    when it equals a key or contains it, so `read_file` also covers `fs_read_file`."""
    budget_share: float = Field(default=0.05, gt=0, le=1)
    """No single output keeps more than this share of the effective budget: the default
    thresholds are for 100K+ windows, and an 8,000-token read cannot fit a 4K budget."""
    min_threshold: int = 64


class CollapseConfig(_Strict):
    window: int = 15
    """Fold runs of at least this many consecutive non-decision-critical messages."""
    user_chars: int = 200
    bloom_capacity: int = 20_000
    """Folded messages a session's filter is sized for (past it, false positives rise slowly).
    It is part of every WAL checkpoint: 20,000 at 0.1% is 36 KB."""
    bloom_error_rate: float = 0.001


class AutocompactConfig(_Strict):
    model: str | None = None
    """A `model_name` of `model_list` that writes summaries; default: the request's model."""
    timeout_s: float = 60.0
    max_failures: int = 3
    """After this many failures in a row Autocompact stops for the session (circuit breaker)."""
    summary_max_tokens: int = 1024
    speculative_ratio: float | None = 0.70
    """Start the summary in the background when a session crosses this share of the budget."""


class RestoreConfig(_Strict):
    budget_ratio: float = 0.10
    """activeRestore may add at most this share of the effective budget."""
    max_files: int = 5
    """Files whose latest content is restored (the newest first)."""
    max_file_names: int = 20
    """Files listed by name (what the agent has been working on)."""
    skill_tokens: int = 1500
    read_tools: list[str] = Field(default_factory=lambda: [
        "read_file", "view", "open", "cat", "str_replace_editor", "edit_file", "write_file",
        "create_file", "str_replace", "edit", "write", "apply_patch", "insert"])
    plan_tools: list[str] = Field(default_factory=lambda: list(PLAN_TOOLS))
    task_tools: list[str] = Field(default_factory=lambda: list(TODO_TOOLS))
    skill_tools: list[str] = Field(default_factory=lambda: ["Skill", "skill", "load_skill", "use_skill"])


class ExpandConfig(_Strict):
    """Reversible compaction (docs/expansion.md): the notes name what was cut as `ref ctx:HEX`,
    the gateway keeps the originals, and the model may ask for one through a tool the
    gateway answers itself."""
    enabled: bool = True
    tool_name: str = Field(default="ctxgate_expand", pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str = ("Get back the original content that context compaction cut out and replaced with a "
                        "note naming `ref ctx:HEX`. Call it only when you need the exact text.")
    max_per_turn: int = Field(default=3, ge=1)
    """Expanding follow-up calls per client request; past them the model is told the limit is
    reached, once, and a reply that still asks has its calls taken out."""
    result_tokens: int = Field(default=16_000, ge=64)
    """The most of an original one tool result carries (less when the turn has less room);
    what does not fit is excerpted, each part left out named by a reference of its own."""
    store_max_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    """Originals kept per session, oldest dropped first."""
    store_ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    """An original older than this is gone."""


class PricesConfig(_Strict):
    """Prices per token (any one unit: only their ratios matter), overriding the route's."""
    input: float = Field(ge=0, allow_inf_nan=False)
    cache_read: float = Field(ge=0, allow_inf_nan=False)
    cache_write: float = Field(ge=0, allow_inf_nan=False)
    output: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class CostConfig(_Strict):
    """How deep a compaction point goes (docs/compaction.md, the cost model)."""
    depth: Literal["cost", "target"] = "cost"
    """`cost`: the target that minimises the expected input cost per turn until the next
    point, between what the agent must keep and `target_ratio`; `target`: `target_ratio` always."""
    min_turns: int = Field(default=8, ge=1)
    """A compaction point should buy room for at least this many turns of the session's growth:
    when keeping the whole recent window would leave less, the window shrinks to its newest
    complete steps (at least one) and the older window is compacted, once, deeply."""
    prices: PricesConfig | None = None
    """Instead of the route's prices from litellm's cost map (a route with none known uses
    conservative defaults: Anthropic's cache ratios)."""
    clear_at_least: int | None = Field(default=None, ge=0)
    """The least a compaction point frees, in tokens: a point that would free less (a target
    just under the request) goes deeper, so a cache break always buys this much room. None: a
    tenth of the effective budget; 0: no minimum."""

    def least_gain(self, budget: int) -> int:
        return budget // 10 if self.clear_at_least is None else self.clear_at_least


_Level = Literal["snip", "microcompact", "collapse", "autocompact"]
_ALL_LEVELS: tuple[_Level, ...] = ("snip", "microcompact", "collapse", "autocompact")


class PipelineConfig(_Strict):
    levels: list[_Level] = Field(default_factory=lambda: list(_ALL_LEVELS))
    safety_ratio: float = 0.95
    """effectiveBudget = max_input_tokens x safety_ratio - reserve_tokens."""
    reserve_tokens: int = 0
    trigger_ratio: float = 0.85
    target_ratio: float = 0.50
    """Compact down to this share of the effective budget (docs/compaction.md)."""
    recent_messages: int = Field(default=10, ge=1)
    """Every level leaves the newest this-many messages byte-identical (the recent window,
    docs/conversation-model.md)."""
    recent_steps: int = Field(default=2, ge=0)
    """...and never fewer than this many complete steps (an action with its observation)."""
    on_exhausted: Literal["error", "degrade"] = "error"
    """When a compaction already ran and the context still does not fit (the loop guard is
    set): CONTEXT_EXHAUSTED, or the degraded mode (one forced Autocompact keeping the
    newest 3 messages) before it."""
    incremental: bool = True
    """Each compaction point adds its note after the earlier ones and leaves them byte-identical,
    so the prefix up to the last note stays cached (docs/compaction.md)."""
    notes_cap_ratio: float = Field(default=0.2, gt=0, le=1)
    """Past this share of the room between what no level removes (instructions, task, tools)
    and the trigger, the earlier notes are merged by the next compaction point (one summary
    of them and the new span; notes with no summary among them are folded into one note, no
    summary asked for): a rare, counted event."""
    pin_first_user: bool = True
    """Keep the task statement (the first user message, or the one after a SWE-agent
    demonstration) through every level."""
    snip: SnipConfig = Field(default_factory=SnipConfig)
    microcompact: MicrocompactConfig = Field(default_factory=MicrocompactConfig)
    collapse: CollapseConfig = Field(default_factory=CollapseConfig)
    autocompact: AutocompactConfig = Field(default_factory=AutocompactConfig)
    restore: RestoreConfig = Field(default_factory=RestoreConfig)
    expand: ExpandConfig = Field(default_factory=ExpandConfig)
    cost: CostConfig = Field(default_factory=CostConfig)

    def window(self) -> RecentWindow:
        return RecentWindow(self.recent_messages, self.recent_steps)

    def watermark_ratio(self) -> float:
        """Where a session may start compacting, as a share of the effective budget: a
        speculation starts there, or, with speculation off, the trigger itself."""
        return min(self.autocompact.speculative_ratio or self.trigger_ratio, self.trigger_ratio)

    def effective_budget(self, max_input_tokens: int) -> int:
        return max(1, int(max_input_tokens * self.safety_ratio) - self.reserve_tokens)


PROFILE_DEFAULTS: dict[str, dict] = {
    "minimal": {"levels": ["snip"], "snip": {"keep_recent": 50}, "expand": {"enabled": False}},
    "professional": {},
    "enterprise": {"reserve_tokens": 1000},
}
