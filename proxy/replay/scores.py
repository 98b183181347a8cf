"""A replay scored as a whole: the probes over its turns, prefix stability, refusals,
compaction points and the cache-aware cost against sending the whole history every turn.

Cost: every turn's request is priced at the cache-read price on its longest common prefix
in whole messages (with the tools schema) with the previous *answered* request, when that
prefix is at least `CACHE_MIN_TOKENS`, and at the cache-write price on the rest; every
summary call's prompt at the input price and its reply at the output price. A refused turn
is priced as if it had been processed: the request the upstream refused or, when ctxgate
refused it first, the client's whole request. The sum is divided by that of the whole
history every turn, each priced the same way against the previous turn's.
"""
from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.policy import CACHE_MIN_TOKENS, Prices
from .driver import Replay, agent_turns
from .probes import PROBES, Need, probe
from .upstream import CTXGATE, UPSTREAM, ProviderCount

Message = dict[str, Any]
OPENAI = Prices(input=1.0, cache_read=0.1, cache_write=1.0, output=4.0, model="OpenAI ratios")
"""OpenAI's cache: reads at a tenth of the input price (gpt-4.1, gpt-5), no charge to write."""
ANTHROPIC = Prices(input=1.0, cache_read=0.1, cache_write=1.25, output=5.0, model="Anthropic ratios")
"""Anthropic's: reads at a tenth, writes at 1.25x (claude-sonnet-4-5's list prices)."""
PRICES = {"OpenAI": OPENAI, "Anthropic": ANTHROPIC}


def mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def costed(requests: list[tuple[list[Message], bool]], provider: ProviderCount) -> list[tuple[int, int, int]]:
    """Per (request, answered) in order: its tokens, the tokens of its longest common prefix in
    whole messages (with the tools schema) with the previous answered request when that is at
    least `CACHE_MIN_TOKENS` (else 0), and that prefix's length in messages."""
    out, previous = [], None
    for msgs, answered in requests:
        fps = [message_fingerprint(m) for m in msgs]
        k = 0
        if previous is not None:
            while k < min(len(fps), len(previous)) and fps[k] == previous[k]:
                k += 1
        cached = provider.tools_tokens + sum(provider.counter.count_structured(m) for m in msgs[:k]) if k else 0
        out.append((provider(msgs), cached if cached >= CACHE_MIN_TOKENS else 0, k))
        if answered:
            previous = fps
    return out


def priced(requests: list[tuple[list[Message], bool]], provider: ProviderCount, prices: Prices,
           summaries: Sequence[tuple[int, int]] = ()) -> float:
    """The cache-aware cost of (request, answered) in order, and of the summary calls (prompt
    and reply tokens)."""
    return (sum(prices.request(tokens, cached) for tokens, cached, _ in costed(requests, provider))
            + sum(prices.summary(prompt, reply) for prompt, reply in summaries))


def whole_history_cost(messages: list[Message], provider: ProviderCount) -> dict[str, float]:
    """Per price set, every turn sending the whole history: what the costs are relative to."""
    whole = [(messages[:i], True) for i in agent_turns(messages)]
    return {name: priced(whole, provider, prices) for name, prices in PRICES.items()}


@dataclass
class RunScore:
    turns: int
    over: int
    """Turns whose whole request is over the limit."""
    probes: dict[str, float | None]
    over_probes: dict[str, float | None]
    """The probes over the `over` turns only."""
    summaries: int
    stable: float | None
    """The share of pairs of consecutive answered turns whose second request starts with the first."""
    stable_outside: float | None
    """The same, leaving out the pairs whose second turn is a compaction point."""
    cost: dict[str, float]
    """Per price set (`PRICES`), relative to `whole_history_cost`."""
    points: int
    refused_ctxgate: float
    refused_upstream: float
    reactive: int = 0
    """Reactive compactions after the upstream refused a request."""
    guard_refusals: int = 0
    """ctxgate's refusals that say the loop guard is still set (an earlier turn was refused)."""
    levels: collections.Counter[str] = field(default_factory=collections.Counter)


def score_run(run: Replay, needs: dict[int, Need], limit: int, provider: ProviderCount,
              messages: list[Message], reference: dict[str, float]) -> RunScore:
    per_turn = [(f, probe(f, needs[f.turn])) for f in run.turns]
    over = [p for f, p in per_turn if needs[f.turn].tokens > limit]
    answered = run.forwarded
    stable = [b.messages[:len(a.messages)] == a.messages for a, b in itertools.pairwise(answered)]
    outside = [ok for (_, b), ok in zip(itertools.pairwise(answered), stable) if not b.compacted]
    requests = [(f.messages if f.refused_by != CTXGATE else messages[:f.turn], not f.refused) for f in run.turns]
    n = max(1, len(run.turns))
    return RunScore(
        turns=len(run.turns), over=len(over),
        probes={k: mean([p[k] for _, p in per_turn]) for k in PROBES},
        over_probes={k: mean([p[k] for p in over]) for k in PROBES},
        summaries=run.summaries, stable=mean([float(x) for x in stable]),
        stable_outside=mean([float(x) for x in outside]),
        cost={name: priced(requests, provider, prices, run.summary_tokens) / reference[name]
              for name, prices in PRICES.items()},
        points=run.points,
        refused_ctxgate=sum(f.refused_by == CTXGATE for f in run.turns) / n,
        refused_upstream=sum(f.refused_by == UPSTREAM for f in run.turns) / n,
        reactive=sum(f.reactive for f in run.turns),
        guard_refusals=sum(f.refused_by == CTXGATE and "without a successful reply" in f.refused for f in run.turns),
        levels=collections.Counter(lv for f in run.turns if f.compacted for lv in f.levels))


def pooled(rs: Sequence[RunScore]) -> dict[str, float | None]:
    """One method's figures over runs: the mean of the per-run figures, and the compaction
    points and summary calls per 100 turns (and per point) over all their turns."""
    out = {k: mean([r.probes[k] for r in rs]) for k in PROBES}
    out.update({f"over_{k}": mean([r.over_probes[k] for r in rs if r.over]) for k in PROBES})
    out.update(summaries=mean([float(r.summaries) for r in rs]), stable=mean([r.stable for r in rs]),
               stable_outside=mean([r.stable_outside for r in rs]),
               **{f"cost_{name}": mean([r.cost[name] for r in rs]) for name in PRICES},
               points=100 * sum(r.points for r in rs) / max(1, sum(r.turns for r in rs)),
               per_point=sum(r.summaries for r in rs) / max(1, sum(r.points for r in rs)),
               summaries_per_100=100 * sum(r.summaries for r in rs) / max(1, sum(r.turns for r in rs)),
               refused=mean([r.refused_ctxgate + r.refused_upstream for r in rs]),
               refused_ctxgate=mean([r.refused_ctxgate for r in rs]),
               refused_upstream=mean([r.refused_upstream for r in rs]))
    return out
