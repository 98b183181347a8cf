"""How deep a compaction point goes: a cost model of the provider's prompt cache.

Every compaction point rewrites what the provider cached after the part it leaves alone,
and may buy a summary. Between two points the prefix is read from the cache and each turn
writes only what it adds. So a point is worth what it costs divided by the turns it buys
until the next forced one (docs/compaction.md, the cost model):

    n(T)       = max(1, (trigger - T) / growth)              turns until the next point
    point(T)   = stable * read + (T - stable) * write + summary_in * input + summary_out * output
    turn_k(T)  = (T + (k - 1) * growth) * read + growth * write          k = 1 .. n - 1
    cost(T)    = (point(T) + sum turn_k(T)) / n(T)           expected input cost per turn

`choose_target` evaluates a grid of targets between the floor (what the agent must keep:
instructions, task, earlier notes, the recent window, a summary's allowance) and the
profile's default target, and takes the cheapest. Everything is in ctxgate's count of the
request's messages; prices are per token in any one unit (only their ratios matter).
"""
from __future__ import annotations

from dataclasses import dataclass

GRID = 16
"""Targets evaluated between the floor and the default."""


CACHE_MIN_TOKENS = 1024
"""Prefixes shorter than this are not cached (OpenAI's and Anthropic's minimum)."""


@dataclass(frozen=True)
class Prices:
    """Per input token, from the cache, written to it, and per output token. A provider that
    charges no cache write (OpenAI) has `cache_write == input`."""
    input: float
    cache_read: float
    cache_write: float
    output: float
    model: str = ""
    """The cost map's entry they were read from ("" when configured or assumed)."""

    def request(self, tokens: int, cached: int) -> float:
        """One request of `tokens` input tokens whose first `cached` the provider has cached."""
        hit = cached if cached >= CACHE_MIN_TOKENS else 0
        hit = min(hit, tokens)
        return hit * self.cache_read + (tokens - hit) * self.cache_write

    def summary(self, prompt: int, output: int) -> float:
        """One summary call: its prompt is new every time (no cache), its reply is output."""
        return prompt * self.input + output * self.output


CONSERVATIVE_PRICES = Prices(input=1.0, cache_read=0.1, cache_write=1.25, output=5.0, model="conservative default")
"""For a route with no known prices: Anthropic's ratios, the dearest cache writes we know,
so a compaction point is never judged cheaper than it may be."""


@dataclass(frozen=True)
class Outlook:
    """What a compaction point knows about its session, in ctxgate's message tokens."""
    trigger: int
    """Where the next compaction point is forced."""
    stable: int
    """The prefix every target keeps byte-identical (instructions, task, earlier notes): still cached."""
    floor: int
    """The least a compaction can land at and keep what the agent needs."""
    default: int
    """The profile's target (`target_ratio`): the shallowest a point may stop at."""
    growth: float
    """Tokens the conversation grows by per turn (observed)."""
    view: int
    """The conversation's size now, before compacting."""
    summary_tokens: int
    """What a summary writes."""


@dataclass(frozen=True)
class Choice:
    target: int
    turns: float
    """Turns the point is expected to buy before the next one."""
    cost_per_turn: float
    """Expected input cost per turn until the next point, in the prices' unit."""


def turns_until_next(target: int, outlook: Outlook) -> float:
    return max(1.0, (outlook.trigger - target) / max(1.0, outlook.growth))


def cost_per_turn(target: int, outlook: Outlook, prices: Prices) -> float:
    """Expected input cost per turn of landing at `target`, over the turns until the next point."""
    n = turns_until_next(target, outlook)
    stable = min(outlook.stable, target)
    summary_in = max(0, outlook.view - target)  # what is summarised (or dropped): read once by the summariser
    point = (stable * prices.cache_read + (target - stable) * prices.cache_write
             + summary_in * prices.input + outlook.summary_tokens * prices.output)
    g = outlook.growth
    following = n - 1
    # sum over k = 1 .. n-1 of (T + (k - 1) g) read + g written, closed form
    turns = following * (target * prices.cache_read + g * prices.cache_write) \
        + prices.cache_read * g * following * (following - 1) / 2
    return (point + turns) / n


def choose_target(outlook: Outlook, prices: Prices) -> Choice:
    """The cheapest target per turn between the floor and the default (the shallowest on a tie)."""
    low, high = outlook.floor, max(outlook.floor, outlook.default)
    best: Choice | None = None
    for k in range(GRID, -1, -1):  # shallowest first: a tie keeps more of the conversation
        target = int(low + (high - low) * k / GRID)
        cost = cost_per_turn(target, outlook, prices)
        if best is None or cost < best.cost_per_turn - 1e-12:
            best = Choice(target, turns_until_next(target, outlook), cost)
    assert best is not None
    return best
