"""A replay's figures, turn by turn and per compaction point: what the table prints and the
report draws, from one place so the two always agree.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.notes import (AUTOCOMPACT_MARKER, COLLAPSE_MARKER, RESTORE_FILE, RESTORE_KINDS, SNIP_MARKER,
                               is_ctxgate_message, kind_of, quoted_text)
from ctxgate.pipeline.tokens import REPLY_PRIMING, TokenCounter
from .costs import CACHE_MIN_TOKENS, Prices
from .driver import Message, Replay
from .formats import TOOL_CALLS, Recording
from .probes import PROBES, needs_of, probe
from .scores import mean
from .upstream import UPSTREAM, ProviderCount

_SUMMARY_START = "key state is kept:\n\n"
_RESTORED_FILE = "Latest content seen of "


@dataclass
class TurnRow:
    turn: int
    """1 for the agent's first request, and so on."""
    sent: int
    """ctxgate's count of what the agent sent (its whole history and the tools schema)."""
    forwarded: int | None
    """What ctxgate forwarded, in the provider's count; None: refused."""
    stable: bool
    """The forwarded request starts byte for byte with the previous forwarded request."""
    cached_sent: int
    """Of `sent`, the prefix the previous request without ctxgate had (the provider's cache)."""
    cached_forwarded: int
    levels: list[str]
    compacted: bool
    """A level ran this turn. A chain that removed nothing still stores a record (the request
    goes out over the limit, see `over_limit_turns`): that is not a compaction point."""
    refused: str
    reactive: int = 0
    """The upstream refused this turn's request so many times, each followed by a reactive compaction."""


@dataclass
class CompactionPoint:
    """One compaction: what it replaced, and the notes it left in the forwarded request."""
    turn: int
    levels: list[str]
    speculative: bool
    tokens_before: int
    tokens_after: int
    messages_replaced: int
    """The client's first messages the compacted prefix stands for."""
    messages_kept: int
    """The messages the compacted prefix holds instead (notes and restore blocks included)."""
    summary: str
    snip_notes: list[str]
    collapse_notes: list[str]
    restored: list[str]
    """The restore blocks (working state), each cut to its first lines."""
    restored_files: list[str]
    steps: list[dict[str, Any]]


@dataclass
class SessionResult:
    name: str
    file: str
    format: str
    dialect: str
    model: str
    limit: int
    """The context limit the session was replayed against (`max_input_tokens`)."""
    effective_budget: int
    trigger: int
    peak: int
    """The agent's largest request: its whole history at its last turn."""
    turns: list[TurnRow]
    compactions: list[CompactionPoint]
    summaries: int
    summarizer: str
    prices: Prices | None
    cost_without: float | None
    """The agent's requests as sent, on the turns ctxgate forwarded."""
    cost_with: float | None
    """The forwarded requests and the summaries."""
    cost_summaries: float | None
    levels_fired: dict[str, list[int]] = field(default_factory=dict)
    """Each level that ran, and the turns it ran at."""
    probes: dict[str, float | None] = field(default_factory=dict)
    """The recoverability probes (proxy/replay/probes.py), each a mean over the turns."""
    reactive: int = 0
    """Reactive compactions after the upstream refused a request (`--enforce-limit`)."""
    refused_by_upstream: int = 0
    summaries_wasted: int = 0
    """Of `summaries`, those paid for whose note was never sent (a background summary whose
    span was gone, or one its point did not keep)."""
    wasted_summary_tokens: int = 0
    """Their tokens: prompt and reply, in the replay's count."""

    @property
    def sent_total(self) -> int:
        return sum(t.sent for t in self.turns)

    @property
    def sent_answered(self) -> int:
        """What the agent sent on the turns that were forwarded (not refused)."""
        return sum(t.sent for t in self.turns if t.forwarded is not None)

    @property
    def forwarded_total(self) -> int:
        return sum(t.forwarded or 0 for t in self.turns)

    @property
    def stable_turns(self) -> int:
        return sum(t.stable for t in self.turns)

    @property
    def refused_turns(self) -> int:
        return sum(bool(t.refused) for t in self.turns)

    @property
    def points_per_100_turns(self) -> float:
        """Compaction points per 100 turns: each rewrites what the provider cached."""
        return 100 * len(self.compactions) / max(1, len(self.turns))

    @property
    def summaries_per_point(self) -> float:
        return self.summaries / max(1, len(self.compactions))

    @property
    def cache_read_tokens(self) -> int:
        """Forwarded tokens a provider reads from its prompt cache (the prefix the previous request had)."""
        return sum(_hit(t.cached_forwarded, t.forwarded) for t in self.turns if t.forwarded is not None)

    @property
    def cache_write_tokens(self) -> int:
        """Forwarded tokens a provider reads afresh (and writes to its cache, where it charges for that)."""
        return sum(t.forwarded - _hit(t.cached_forwarded, t.forwarded) for t in self.turns if t.forwarded is not None)

    @property
    def over_limit_turns(self) -> list[int]:
        """Turns whose forwarded request is still over the limit: a provider would refuse it,
        and the gateway would then compact reactively, which a replay does not model."""
        return [t.turn for t in self.turns if t.forwarded is not None and t.forwarded > self.limit]

    @property
    def probes_text(self) -> str:
        """`task/files/error/latest`, each a share of 1 or `-` where it does not apply."""
        return "/".join("-" if self.probes.get(k) is None else f"{self.probes[k]:.2f}" for k in PROBES[:4])

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(sent_total=self.sent_total, sent_answered=self.sent_answered, forwarded_total=self.forwarded_total,
                    stable_turns=self.stable_turns, refused_turns=self.refused_turns,
                    over_limit_turns=self.over_limit_turns, points_per_100_turns=self.points_per_100_turns,
                    summaries_per_point=self.summaries_per_point, cache_read_tokens=self.cache_read_tokens,
                    cache_write_tokens=self.cache_write_tokens)
        return data


def _hit(cached: int, tokens: int) -> int:
    """What the provider's cache serves of a request whose prefix of `cached` tokens repeats."""
    return min(cached, tokens) if cached >= CACHE_MIN_TOKENS else 0


def _common_prefix(a: list[bytes], b: list[bytes]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def _encoded(messages: list[Message]) -> list[bytes]:
    return [orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for m in messages]


def _cached(counter: TokenCounter, messages: list[Message], k: int, tools_tokens: int) -> int:
    """What a provider has cached of a request whose first `k` messages repeat the previous one's."""
    return tools_tokens + (counter.count_messages(messages[:k]) if k else 0)


def turn_rows(recording: Recording, run: Replay, counter: TokenCounter) -> list[TurnRow]:
    tools_tokens = counter.count_tools(recording.tools)
    # The agent's requests are prefixes of one history: its previous request is the cached
    # prefix of the next, and each message is counted once.
    counted = [0]
    for m in recording.messages:
        counted.append(counted[-1] + counter.count_structured(m))
    rows: list[TurnRow] = []
    previous_sent = 0
    previous_forwarded: list[bytes] | None = None
    for n, f in enumerate(run.turns, 1):
        cached_sent = tools_tokens + counted[previous_sent] + REPLY_PRIMING if previous_sent else 0
        previous_sent = f.turn
        stable, cached_forwarded = False, 0
        if not f.refused:
            forwarded = _encoded(f.messages)
            if previous_forwarded is not None:
                k = _common_prefix(previous_forwarded, forwarded)
                stable = k == len(previous_forwarded)
                cached_forwarded = _cached(counter, f.messages, k, tools_tokens)
            previous_forwarded = forwarded
        levels = (f.record.levels if f.record is not None and not f.levels else f.levels) if f.compacted else []
        rows.append(TurnRow(n, f.tokens_in, None if f.refused else f.tokens, stable, cached_sent, cached_forwarded,
                            list(dict.fromkeys(levels)), bool(levels), f.refused, f.reactive))
    return rows


def _summary_of(note: str) -> str:
    start = note.find(_SUMMARY_START)
    return note[start + len(_SUMMARY_START):] if start >= 0 else note


def _head(text: str, lines: int = 6) -> str:
    kept = text.splitlines()
    return "\n".join(kept[:lines]) + (f"\n… ({len(kept) - lines} more lines)" if len(kept) > lines else "")


def compaction_points(run: Replay, rows: list[TurnRow]) -> list[CompactionPoint]:
    points: list[CompactionPoint] = []
    seen: set[str] = set()
    for f, row in zip(run.turns, rows):
        if f.record is None or not row.compacted:
            continue
        notes = [quoted_text(m) for m in f.record.messages if is_ctxgate_message(m)]
        restored = [quoted_text(m) for m in f.record.messages if kind_of(m) in RESTORE_KINDS]
        files = [quoted_text(m) for m in f.record.messages if kind_of(m) == RESTORE_FILE]
        new = [n for n in notes if n not in seen]
        seen.update(notes)
        # A summary is shown at every Autocompact (it may repeat an earlier one word for word);
        # Snip and Collapse notes only where they first appear (they persist in later records).
        summaries = [_summary_of(n) for n in notes if n.startswith(AUTOCOMPACT_MARKER)] \
            if "autocompact" in row.levels else []
        points.append(CompactionPoint(
            turn=row.turn, levels=row.levels, speculative=f.speculative, tokens_before=f.record.tokens_before,
            tokens_after=f.record.tokens_after, messages_replaced=f.record.prefix_len,
            messages_kept=len(f.record.messages), summary="\n\n".join(summaries),
            snip_notes=[_head(n) for n in new if n.startswith(SNIP_MARKER)],
            collapse_notes=[_head(n) for n in new if n.startswith(COLLAPSE_MARKER)],
            restored=[_head(n, 3) for n in restored],
            restored_files=[n[len(_RESTORED_FILE):].split(":\n", 1)[0] for n in files
                            if n.startswith(_RESTORED_FILE)],
            steps=f.steps))
    return points


def levels_fired(rows: list[TurnRow]) -> dict[str, list[int]]:
    fired: dict[str, list[int]] = {}
    for row in rows:
        for level in row.levels:
            fired.setdefault(level, []).append(row.turn)
    return fired


@dataclass(frozen=True)
class Setting:
    """What one session was replayed with."""
    file: str
    format: str
    model: str
    limit: int
    config: PipelineConfig
    peak: int
    summarizer: str
    summary_calls: list[tuple[int, int]]
    """(prompt tokens, summary tokens) of each summary call of this session."""
    prices: Prices | None


def probe_means(recording: Recording, run: Replay, counter: TokenCounter) -> dict[str, float | None]:
    needs = needs_of(recording.messages, recording.dialect != TOOL_CALLS, ProviderCount(counter, recording.tools))
    scored = [probe(f, needs[f.turn]) for f in run.turns]
    return {k: mean([p[k] for p in scored]) for k in PROBES}


def session_result(recording: Recording, run: Replay, counter: TokenCounter, setting: Setting) -> SessionResult:
    rows = turn_rows(recording, run, counter)
    budget = setting.config.effective_budget(setting.limit)
    prices = setting.prices
    without = with_ctxgate = summaries = None
    if prices is not None:
        # Over the turns ctxgate forwarded: a refused turn costs nothing with ctxgate, and
        # pricing it without would credit ctxgate with a turn the agent never got answered.
        without = sum(prices.request(r.sent, r.cached_sent) for r in rows if r.forwarded is not None)
        summaries = sum(prices.summary(p, o) for p, o in setting.summary_calls)
        with_ctxgate = sum(prices.request(r.forwarded, r.cached_forwarded) for r in rows
                           if r.forwarded is not None) + summaries
    return SessionResult(
        name=recording.name, file=setting.file, format=setting.format, dialect=recording.dialect, model=setting.model,
        limit=setting.limit, effective_budget=budget, trigger=int(setting.config.trigger_ratio * budget),
        peak=setting.peak, turns=rows, compactions=compaction_points(run, rows), summaries=run.summaries,
        summarizer=setting.summarizer, prices=prices, cost_without=without, cost_with=with_ctxgate,
        cost_summaries=summaries, levels_fired=levels_fired(rows), probes=probe_means(recording, run, counter),
        reactive=sum(f.reactive for f in run.turns),
        refused_by_upstream=sum(f.refused_by == UPSTREAM for f in run.turns),
        summaries_wasted=sum(calls for _, calls, _ in run.wasted),
        wasted_summary_tokens=sum(tokens for _, _, tokens in run.wasted))
