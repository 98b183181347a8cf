"""Scoring one method's replay of one run (bench/dialects.py): the probes on each turn's
forwarded request, prefix stability, the cache-aware cost. Definitions in bench/dialects.py.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any

from ctxgate.pipeline.fingerprint import message_fingerprint
from ctxgate.pipeline.policy import Prices
from ctxgate.pipeline.turns import is_valid_sequence
from dialect_replay import CTXGATE, UPSTREAM, MethodRun, ProviderCount, Sent
from recoverability import (
    last_error_line,
    norm,
    task_present,
    task_statement_index,
    text_of,
    touched_files,
)
from turn_replay import agent_turns

Message = dict[str, Any]
LATEST = 6
"""The last messages of the request that should arrive verbatim."""
CACHE_MIN = 1024
PROBES = ("task", "files", "error", "latest", "valid")
OPENAI = Prices(input=1.0, cache_read=0.1, cache_write=1.0, output=4.0, model="OpenAI ratios")
"""OpenAI's cache: reads at a tenth of the input price (gpt-4.1, gpt-5), no charge to write."""
ANTHROPIC = Prices(input=1.0, cache_read=0.1, cache_write=1.25, output=5.0, model="Anthropic ratios")
"""Anthropic's: reads at a tenth, writes at 1.25x (claude-sonnet-4-5's list prices)."""
PRICES = {"OpenAI": OPENAI, "Anthropic": ANTHROPIC}


@dataclass
class Need:
    """What the agent needs at one turn, read from that turn's whole request."""
    task: str
    files: list[str]
    error: str | None
    latest: list[tuple]
    tokens: int


def needs_of(messages: list[Message], text_mode: bool, provider: ProviderCount) -> dict[int, Need]:
    out = {}
    for i in agent_turns(messages):
        request = messages[:i]
        task = task_statement_index(request)
        out[i] = Need(text_of(request[task]) if task is not None else "", touched_files(request, text_mode),
                      last_error_line(request, text_mode), [norm(m) for m in request[-LATEST:]], provider(request))
    return out


def probe(sent: Sent, need: Need) -> dict[str, float | None]:
    files = 0.0 if need.files else None
    error = 0.0 if need.error else None
    if sent.refused or sent.messages is None:
        return {"task": 0.0, "files": files, "error": error, "latest": 0.0, "valid": 0.0}
    out = sent.messages
    blob = "\n\x00\n".join(text_of(m) for m in out)
    kept = {norm(m) for m in out}
    return {"task": 1.0 if task_present(need.task, out) else 0.0,
            "files": sum(p in blob for p in need.files) / len(need.files) if need.files else None,
            "error": (1.0 if need.error in blob else 0.0) if need.error else None,
            "latest": sum(n in kept for n in need.latest) / len(need.latest),
            "valid": 1.0 if is_valid_sequence(out) else 0.0}


def mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def priced(requests: list[tuple[list[Message], bool]], provider: ProviderCount, prices: Prices,
           summaries: list[tuple[int, int]] = ()) -> float:  # type: ignore[assignment]
    """Cache-aware cost of (request, answered) in order, and of the summary calls (prompt and
    reply tokens): see the module doc of bench/dialects.py."""
    total, previous = 0.0, None
    for msgs, answered in requests:
        fps = [message_fingerprint(m) for m in msgs]
        tokens = provider(msgs)
        k = 0
        if previous is not None:
            while k < min(len(fps), len(previous)) and fps[k] == previous[k]:
                k += 1
        cached = provider.tools_tokens + sum(provider.counter.count_structured(m) for m in msgs[:k]) if k else 0
        total += prices.request(tokens, cached if cached >= CACHE_MIN else 0)
        if answered:
            previous = fps
    return total + sum(prices.summary(prompt, reply) for prompt, reply in summaries)


@dataclass
class RunScore:
    turns: int
    over: int
    """Turns whose whole request is over the limit."""
    probes: dict[str, float | None]
    over_probes: dict[str, float | None]
    summaries: int
    stable: float | None
    stable_outside: float | None
    cost: dict[str, float]
    """Per price set (`PRICES`), relative to no compaction at the same prices."""
    points: int
    """ctxgate's compaction points (turns whose compaction records changed)."""
    refused_ctxgate: float
    refused_upstream: float
    guard_refusals: int = 0
    """ctxgate's refusals before the upstream that say the loop guard is still set (an earlier turn was refused)."""
    levels: collections.Counter[str] = field(default_factory=collections.Counter)


def score_run(run: MethodRun, needs: dict[int, Need], limit: int, provider: ProviderCount,
              messages: list[Message], reference: dict[str, float], is_ctxgate: bool) -> RunScore:
    per_turn = [(s, probe(s, needs[s.turn])) for s in run.sent]
    over = [(s, p) for s, p in per_turn if needs[s.turn].tokens > limit]
    answered = [(s, s.messages) for s in run.sent if not s.refused and s.messages is not None]
    pairs = [(a, b) for (a, _), (b, _) in itertools.pairwise(answered)]
    stable = [mb[:len(ma)] == ma for (_, ma), (_, mb) in itertools.pairwise(answered)]
    outside = [ok for (a, b), ok in zip(pairs, stable) if not b.compacted]
    requests = [(s.messages if s.messages is not None else messages[:s.turn], not s.refused) for s in run.sent]
    n = len(run.sent)
    return RunScore(
        turns=n, over=len(over),
        probes={k: mean([p[k] for _, p in per_turn]) for k in PROBES},
        over_probes={k: mean([p[k] for _, p in over]) for k in PROBES},
        summaries=run.summaries, stable=mean([float(x) for x in stable]),
        stable_outside=mean([float(x) for x in outside]) if is_ctxgate else None,
        cost={name: priced(requests, provider, prices, run.summary_tokens) / reference[name]
              for name, prices in PRICES.items()},
        points=sum(s.compacted for s in run.sent),
        refused_ctxgate=sum(s.refused == CTXGATE for s in run.sent) / n,
        refused_upstream=sum(s.refused == UPSTREAM for s in run.sent) / n,
        guard_refusals=sum(s.refused == CTXGATE and "without a successful reply" in s.note for s in run.sent),
        levels=collections.Counter(lv for s in run.sent if s.compacted for lv in s.levels))


def floor_of(messages: list[Message], provider: ProviderCount) -> int:
    """The least any request of the run needs: the leading system message(s), the task
    statement and the tools schema. A run whose floor is over the limit cannot be served."""
    task = task_statement_index(messages)
    return provider([m for i, m in enumerate(messages) if i == task or (i == 0 and m.get("role") == "system")])
