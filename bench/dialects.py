"""Recoverability per dialect: every recorded run (tests/trajectories.py: every_dialect)
replayed through `ctxgate replay`'s driver, ctxgate beside drop-oldest and middle-out
(proxy/replay/baselines.py); each source's runs also joined into one long session.

Every run is replayed turn by turn as its agent sent it, at limits of 50% and 25% of its final size
(messages + tools schema, o200k): the upstream refuses a request over the limit and otherwise
answers with the recorded reply. ctxgate runs in process as the gateway does (prepare under the
session lock, max_input_tokens = the limit, one reactive compaction and retry on a refusal, the loop
guard reset by an answered turn only, speculation on). **The summaries are scripted, not an LLM**:
*stand-in* quotes the span's task, tools, last remark, last error line and file paths; *empty* is
the six headings with nothing under them (what the machinery alone keeps). Scores are means over
each run's turns, then over the dialect's runs (*(runs)*: runs where the probe applies); a refused
turn scores 0 on every probe. *prefix-stable*: pairs of consecutive answered turns whose second
request starts with the first; after the slash, leaving out the pairs at ctxgate's compaction
points. *cost*: cached prefixes (≥ 1,024 tokens, whole messages, against the previous answered
request) at the cache-read price, the rest at the cache-write price (OpenAI ratios: 0.1 / 1;
Anthropic: 0.1 / 1.25), summary calls priced in and out, refused turns priced as if processed,
relative to sending the whole history every turn with the same caching. *compaction points / 100
turns* and *summary calls / point* over the dialect's runs. Definitions: `bench/dialects.py`,
`proxy/replay/` (the driver `ctxgate replay` runs, with the limit enforced).

    .venv/bin/python bench/dialects.py                        # writes its section of RESULTS.md
    .venv/bin/python bench/dialects.py --only "OpenHands text" --limit 2 --out /tmp/x.md
"""
from __future__ import annotations

import asyncio
import collections
import math
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

import common
from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.turns import is_valid_sequence, leading_instructions
from ctxgate.proxy.replay.baselines import BASELINES, baseline_replay
from ctxgate.proxy.replay.driver import Forwarded, Replay, agent_turns, replay
from ctxgate.proxy.replay.probes import (ERROR_MARKERS, LATEST, PATH_RE, PROBES, floor_of, needs_of, observations,
                                         probe, squash, task_statement_index)
from ctxgate.proxy.replay.scores import PRICES, RunScore, costed, pooled, score_run, whole_history_cost
from ctxgate.proxy.replay.upstream import CTXGATE, ProviderCount
from trajectories import DIALECTS, TOOL_CALLS, Trajectory, dialect_of

Message = dict[str, Any]
RATIOS = (0.50, 0.25)
EMPTY_SUMMARY = ("1. Goal:\n2. Completed steps:\n3. Key decisions:\n4. Open problems:\n5. Current files:\n"
                 "6. Tool context:")


async def stand_in_summary(prompt: list[Message]) -> str:
    """A deterministic six-field summary of the span Autocompact sends: its first user
    message, the tools called, the last assistant remark, the last error line, every path."""
    text = (prompt[-1].get("content") or "").split("Conversation history:", 1)[-1]
    blocks = re.split(r"\n\n(?=\[(?:system|developer|user|assistant|tool)\] )", text.strip())
    first_user = next((b[len("[user] "):] for b in blocks if b.startswith("[user] ")), "")
    last_assistant = next((b[len("[assistant] "):] for b in reversed(blocks)
                           if b.startswith("[assistant] ") and b[len("[assistant] "):].strip()), "")
    tools = collections.Counter(re.findall(r"\[called ([\w.\-]+)\(", text))
    paths = list(dict.fromkeys(reversed(PATH_RE.findall(text))))[:25]
    error = next((line.strip()[:200] for line in reversed(text.splitlines())
                  if any(k in line for k in ERROR_MARKERS)), "")
    tool_list = ", ".join(f"{n} ×{c}" for n, c in tools.most_common()) or "none"
    return "\n".join([
        f"1. Goal: {squash(first_user)[:300] or 'not stated in this span'}",
        f"2. Completed steps: {len(blocks)} messages summarised; tools called: {tool_list}",
        f"3. Key decisions: last assistant remark: {squash(last_assistant)[:200] or 'none'}",
        f"4. Unresolved problems: {error or 'no error seen'}",
        f"5. Files: {', '.join(paths) or 'none seen'}",
        f"6. Skill/tool context: {', '.join(tools) or 'none'}",
    ])


async def empty_summary(_: list[Message]) -> str:
    return EMPTY_SUMMARY


STAND_IN, EMPTY = "ctxgate, stand-in summary", "ctxgate, empty summary"
METHODS = (STAND_IN, EMPTY, *BASELINES)
SUMMARIES: dict[str, Callable[[list[Message]], Awaitable[str]]] = {STAND_IN: stand_in_summary, EMPTY: empty_summary}


@dataclass
class RunResult:
    name: str
    source: str
    dialect: str
    scores: dict[float, dict[str, RunScore] | None]
    """Per ratio, each method's scores; None when the limit is below the run's floor (system
    prompt, task, tools schema)."""
    floor_share: dict[float, float]
    least_points: dict[float, int]
    """Per ratio, the fewest compaction points any compactor needs under ctxgate's trigger."""
    least_points_at_limit: dict[float, int]
    allowed: dict[float, "Allowed"] = field(default_factory=dict)
    """Per ratio, what the limit allows any compactor that keeps the system prompt and the task."""


@dataclass
class Allowed:
    """What a run's limit allows a compactor that keeps the system prompt, the task statement
    and the tools schema: an upper bound (ctxgate forwards within the effective budget, 95% of
    the limit, unless those alone are over it: issue 36 item 8)."""
    latest: float
    """The mean over turns of the share of the newest `LATEST` messages that can fit beside them, whole."""
    short: int
    """Turns where fewer than the newest `LATEST` fit."""
    unservable: int
    """Turns where not even the last message fits (an observation cut to Microcompact's least)."""
    over_budget: int
    """Turns where it fits the limit but not the effective budget: ctxgate refuses them (issue 36
    item 8: its count may be off by the margin), a compactor that trusts its count to the token
    need not."""


def allowed(messages: list[Message], text_mode: bool, provider: ProviderCount, limit: int) -> Allowed:
    cfg = PipelineConfig()
    least = cfg.microcompact.min_threshold + 16  # the least an observation is cut to, with its separator
    line = limit
    floor = floor_of(messages, provider)
    budget = cfg.effective_budget(limit) if floor <= cfg.effective_budget(limit) else limit
    shares, short, unservable, over_budget = [], 0, 0, 0
    for i in agent_turns(messages):
        request = messages[:i]
        task = task_statement_index(request)
        head = [k for k in range(len(request)) if k == task or (k == 0 and request[k].get("role") == "system")]
        want = min(LATEST, len(request))
        window = set(range(len(request) - want, len(request)))
        # The most of the newest messages that fit whole beside the head: the smallest first (the
        # others cut or dropped, at no cost here: an upper bound); the head counts where it is among them.
        chosen = set(head)
        for k in sorted(window - chosen, key=lambda k: provider.counter.count_structured(request[k])):
            if provider([request[j] for j in sorted(chosen | {k})]) > line:
                break
            chosen.add(k)
        kept = len(window & chosen)
        shares.append(kept / want)
        short += kept < want
        last = request[-1]
        observation = last in observations(request, text_mode) and len(request) - 1 not in head
        cost = provider([request[k] for k in head]) + (0 if len(request) - 1 in head else min(
            provider.counter.count_structured(last), least) if observation else provider.counter.count_structured(last))
        unservable += cost > line
        over_budget += budget < cost <= line
    return Allowed(sum(shares) / max(1, len(shares)), short, unservable, over_budget)


def runs(only: str | None, limit: int | None) -> list[tuple[str, Trajectory, str, list[Message]]]:
    """(name, trajectory, dialect, request-ready messages) of the chosen runs."""
    out: list[tuple[str, Trajectory, str, list[Message]]] = []
    per_dialect: collections.Counter[str] = collections.Counter()
    for name, t, msgs in common.named_trajectories(every=True):
        dialect = dialect_of(t)
        if (only and slug(only) != slug(dialect)) or not agent_turns(msgs) \
                or (limit is not None and per_dialect[dialect] >= limit):
            continue
        per_dialect[dialect] += 1
        out.append((name, t, dialect, msgs))
    return out


LONG_TOKENS = 150_000
"""A long session stops adding runs once it is this big (o200k, messages)."""


def long_sessions(chosen: list[tuple[str, Trajectory, str, list[Message]]], counter: Any
                  ) -> list[tuple[str, Trajectory, str, list[Message]]]:
    """Per source and dialect, its runs back to back as one session (each later run without its
    system prompt, as the next task), up to `LONG_TOKENS`, runs with the first one's tools schema only."""
    out = []
    for source, dialect in dict.fromkeys((t.source, d) for _, t, d, _ in chosen):
        group = [(t, d, m) for _, t, d, m in chosen if (t.source, d) == (source, dialect)]
        first, _, messages = group[0]
        tools = orjson.dumps(first.tools)
        session, joined = list(messages), 1
        for t, d, m in group[1:]:
            if counter.count_messages(session) >= LONG_TOKENS:
                break
            body = m[leading_instructions(m):]
            if orjson.dumps(t.tools) != tools or not is_valid_sequence(session + body):
                continue
            session += body
            joined += 1
        if joined > 1:
            name = f"{source} ({dialect}): {joined} runs back to back"
            out.append((name, replace(first, name=name, messages=session), dialect, session))
    return out


def slug(text: str) -> str:
    return "-".join(text.lower().replace("-", " ").split())


class TurnSummaries:
    """A summarizer that keeps its calls' tokens (prompt, reply; counted as the driver counts
    them) by the turn they were made for: while that turn was prepared, or in the background
    after the turn before it (a speculation ready for it)."""

    def __init__(self, summarize: Callable[[list[Message]], Awaitable[str]], counter: Any) -> None:
        self.summarize, self.counter = summarize, counter
        self.pending, self.by_turn = (0, 0), dict[int, tuple[int, int]]()

    async def __call__(self, prompt: list[Message]) -> str:
        text = await self.summarize(prompt)
        self.pending = (self.pending[0] + self.counter.count_messages(prompt),
                        self.pending[1] + self.counter.count(text))
        return text

    def on_turn(self, f: Forwarded) -> None:
        self.by_turn[f.turn], self.pending = self.pending, (0, 0)


def turn_costs(run: Replay, messages: list[Message], provider: ProviderCount,
               paid: TurnSummaries) -> dict[int, dict[str, Any]]:
    """Per turn, the pieces `score_run` prices (`--turns`): the request priced (`sent` tokens, of
    them `cached`, a common prefix of `prefix` messages with the previous answered request),
    whether an answered request starts with the previous answered one (`stable`), the summary
    calls made for it (a call still pending when the run ends goes with the last turn), and the
    whole history's `whole_sent` / `whole_cached` that turn (what the cost is relative to)."""
    priced = costed([(f.messages if f.refused_by != CTXGATE else messages[:f.turn], not f.refused)
                     for f in run.turns], provider)
    whole = dict(zip(agent_turns(messages), costed([(messages[:i], True) for i in agent_turns(messages)], provider)))
    summaries = {f.turn: paid.by_turn.get(f.turn, (0, 0)) for f in run.turns}
    if run.turns and paid.pending != (0, 0):
        last = summaries[run.turns[-1].turn]
        summaries[run.turns[-1].turn] = (last[0] + paid.pending[0], last[1] + paid.pending[1])
    out: dict[int, dict[str, Any]] = {}
    previous: list[Message] | None = None
    for f, (sent, cached, prefix) in zip(run.turns, priced):
        stable = None if f.refused or previous is None else f.messages[:len(previous)] == previous
        if not f.refused:
            previous = f.messages
        out[f.turn] = {"sent": sent, "cached": cached, "prefix": prefix, "stable": stable, "compacted": f.compacted,
                       "summary": list(summaries[f.turn]), "whole_sent": whole[f.turn][0],
                       "whole_cached": whole[f.turn][1]}
    return out


def evaluate(name: str, t: Trajectory, dialect: str, messages: list[Message], counter: Any,
             loop: asyncio.AbstractEventLoop, per_turn: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    """Every method on one run at every ratio. `per_turn` gets each turn of ctxgate (stand-in)
    with its probes: how `--turns` compares two commits turn by turn (bench/replay_old_commit.py)."""
    provider = ProviderCount(counter, t.tools)
    needs = needs_of(messages, dialect != TOOL_CALLS, provider)
    reference = whole_history_cost(messages, provider)
    final, floor = provider(messages), floor_of(messages, provider)
    out: dict[float, dict[str, RunScore] | None] = {}
    for ratio in RATIOS:
        limit = int(ratio * final)
        if floor > limit:
            out[ratio] = None
            continue
        scores = {}
        for method in METHODS:
            paid = TurnSummaries(SUMMARIES[method], counter) if method in SUMMARIES else None
            run = (loop.run_until_complete(replay(messages, t.tools, limit, counter=counter, provider_count=provider,
                                                  summarize=paid, wait_background=True, enforce_limit=True,
                                                  on_turn=paid.on_turn))
                   if paid is not None else baseline_replay(messages, limit, BASELINES[method], provider))
            scores[method] = score_run(run, needs, limit, provider, messages, reference)
            if per_turn is not None and paid is not None and method == STAND_IN:
                cost = turn_costs(run, messages, provider, paid)
                for f in run.turns:
                    per_turn({"run": name, "dialect": dialect, "ratio": ratio, "turn": f.turn,
                              "refused_by": f.refused_by, "refused": f.refused[:200], "tokens": f.tokens,
                              "needed": needs[f.turn].tokens, "levels": f.levels, **probe(f, needs[f.turn]),
                              **cost[f.turn]})
        out[ratio] = scores

    def fewest(trigger: float) -> int:
        over = sum(needs[i].tokens > trigger for i in agent_turns(messages))  # at most a point per such turn
        return min(over, math.ceil(max(0.0, final - trigger) / max(1.0, trigger - floor)))

    cfg = PipelineConfig()
    least = {ratio: fewest(cfg.trigger_ratio * cfg.effective_budget(int(ratio * final))) for ratio in RATIOS}
    at_limit = {ratio: fewest(int(ratio * final)) for ratio in RATIOS}
    bounds = {ratio: allowed(messages, dialect != TOOL_CALLS, provider, int(ratio * final))
              for ratio in RATIOS if out[ratio] is not None}
    return RunResult(name, t.source, dialect, out, {ratio: floor / max(1, int(ratio * final)) for ratio in RATIOS},
                     least, at_limit, bounds)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def fmt(v: float | None, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def method_rows(scored: list[dict[str, RunScore]], label: str = "") -> list[list[str]]:
    rows = []
    for m in METHODS:
        rs = [s[m] for s in scored]
        f = pooled(rs)
        n_files = sum(r.probes["files"] is not None for r in rs)
        n_err = sum(r.probes["error"] is not None for r in rs)
        stable = pct(f["stable"]) + (f" / {pct(f['stable_outside'])}" if m in SUMMARIES else "")
        rows.append(([label] if label else []) + [
            m, fmt(f["task"]), f"{fmt(f['files'])} ({n_files})", f"{fmt(f['error'])} ({n_err})", fmt(f["latest"]),
            fmt(f["valid"]), fmt(f["summaries"], 1),
            fmt(f["points"], 1) if m in SUMMARIES else "n/a", fmt(f["per_point"], 2) if m in SUMMARIES else "n/a",
            stable, *(fmt(f[f"cost_{name}"]) for name in PRICES),
            f"{pct(f['refused'])} ({pct(f['refused_ctxgate'])} / {pct(f['refused_upstream'])})"])
    return rows


HEADERS = ["method", "task", "files (runs)", "last error (runs)", "last 6 verbatim", "valid pairing",
           "summary calls / run", "compaction points / 100 turns", "summary calls / point",
           "prefix-stable (strict / outside compaction points)", "cost vs no compaction (OpenAI)",
           "cost vs no compaction (Anthropic)",
           "refused (by ctxgate / by the upstream)"]


def feasible(results: list[RunResult], dialect: str, ratio: float) -> list[tuple[RunResult, dict[str, RunScore]]]:
    """The dialect's runs whose floor fits the limit, with their scores at that ratio."""
    return [(r, s) for r in results if r.dialect == dialect and (s := r.scores[ratio]) is not None]


def dialect_section(results: list[RunResult], dialect: str, ratio: float) -> str:
    total = sum(r.dialect == dialect for r in results)
    ok = feasible(results, dialect, ratio)
    scored = [s for _, s in ok]
    lines = [f"#### {dialect} at {ratio:.0%}"]
    if len(ok) < total:
        lines.append(f"\n{total - len(ok)} of {total} runs left out: their system prompt + task (+ tools schema) alone "
                     f"exceed the limit, so every method is refused on every turn.")
    if not scored:
        return "\n".join(lines) + "\n"
    ours = [s[STAND_IN] for s in scored]
    turns, over = sum(r.turns for r in ours), sum(r.over for r in ours)
    shares = [r.floor_share[ratio] for r, _ in ok]
    lines.append(f"\n{plural(len(ok), 'run')}, {plural(turns, 'turn')}, {over} of them with a whole request over "
                 f"the limit. The system prompt + task (+ tools schema) take {100 * common.median(shares):.0f}% of "
                 f"the limit (median); more than ctxgate's compaction target (47.5% of it) in "
                 f"{sum(x > 0.475 for x in shares)} runs.\n")
    lines.append(common.table(HEADERS, method_rows(scored)))
    sources = sorted({r.source for r, _ in ok})
    if len(sources) > 1:
        rows = []
        for src in sources:
            mine = [s for r, s in ok if r.source == src]
            rows += method_rows(mine, f"{src} ({len(mine)})")
        lines.append("\nBy source:\n")
        lines.append(common.table(["source (runs)", *HEADERS], rows, "ll" + "r" * (len(HEADERS) - 1)))
    if 0 < over < turns:
        rows = []
        for m in METHODS:
            f = pooled([s[m] for s in scored])
            rows.append([m, *(fmt(f[f"over_{k}"]) for k in PROBES)])
        lines.append(f"\nThe probes over the {over} turns whose whole request is over the limit only (mean over the "
                     f"{sum(1 for r in ours if r.over)} runs that have such turns):\n")
        lines.append(common.table(["method", "task", "files", "last error", "last 6 verbatim", "valid pairing"], rows))
    levels: collections.Counter[str] = collections.Counter()
    for r in ours:
        levels.update(r.levels)
    guard = sum(r.guard_refusals for r in ours)
    lines.append("\nctxgate (stand-in) levels at its compaction points: "
                 + (", ".join(f"{lv} ×{n}" for lv, n in levels.most_common()) or "none")
                 + (f"; {guard} of its refusals before the upstream came with the loop guard still set by an "
                    "earlier refused turn" if guard else "") + ".\n")
    return "\n".join(lines)


SCOREBOARD = (("task", "task", 1), ("files", "files", 1), ("error", "last error", 1), ("latest", "last 6", 1),
              ("valid", "valid", 1), ("stable", "prefix-stable", 1), ("cost_OpenAI", "cost (OpenAI)", -1),
              ("cost_Anthropic", "cost (Anthropic)", -1),
              ("refused", "refused", -1))
"""(summary key, label, +1 when higher is better / -1 when lower is)."""


def versus(scored: list[dict[str, RunScore]]) -> dict[str, tuple[float, float, int] | None]:
    """Per scoreboard probe: (ctxgate stand-in, the best baseline, +1 ahead / 0 level / -1 behind)."""
    figs = {m: pooled([s[m] for s in scored]) for m in METHODS}
    out: dict[str, tuple[float, float, int] | None] = {}
    for key, _, sign in SCOREBOARD:
        ours = figs[STAND_IN][key]
        theirs = [v for v in (figs[b][key] for b in BASELINES) if v is not None]
        if ours is None or not theirs:
            out[key] = None
            continue
        best = max(theirs) if sign > 0 else min(theirs)
        out[key] = (ours, best, 0 if abs(ours - best) < 5e-4 else (1 if (ours - best) * sign > 0 else -1))
    return out


def cells(results: list[RunResult]) -> Iterator[tuple[float, str, list[tuple[RunResult, dict[str, RunScore]]]]]:
    """(ratio, dialect, its feasible runs with their scores) of every table's rows that have runs."""
    for ratio in RATIOS:
        for d in DIALECTS:
            if ok := feasible(results, d, ratio):
                yield ratio, d, ok


def scoreboard(results: list[RunResult]) -> str:
    """ctxgate (stand-in) against the best baseline on every probe, per dialect and ratio."""
    rows = []
    marks = {1: "ahead", 0: "=", -1: "**behind**"}
    for ratio, d, ok in cells(results):
        versus_best = versus([s for _, s in ok])
        rows.append([f"{d} at {ratio:.0%} ({len(ok)})"] + [
            "n/a" if c is None else f"{fmt(c[0])} vs {fmt(c[1])} {marks[c[2]]}"
            for c in (versus_best[key] for key, _, _ in SCOREBOARD)])
    return common.table(["dialect at limit (runs)", *(label for _, label, _ in SCOREBOARD)], rows)


def aims(results: list[RunResult]) -> str:
    """The issue's aims, checked: ahead of the best baseline on every probe in every
    dialect; at 50%, task, files and last error at 0.95 or more."""
    behind, low = [], []
    for ratio, d, ok in cells(results):
        versus_best = versus([s for _, s in ok])
        for key, label, _ in SCOREBOARD:
            c = versus_best[key]
            if c is not None and c[2] < 0:
                behind.append(f"{d} {ratio:.0%} {label}")
            if c is not None and ratio == 0.50 and key in ("task", "files", "error") and c[0] < 0.95:
                low.append(f"{d} {label} {fmt(c[0])}")
    return ("Against the issue's aims (ctxgate with the stand-in summary): behind the best baseline in "
            + (f"{len(behind)} dialect × limit × probe cells: {'; '.join(behind)}" if behind else "no cell")
            + ". At 50%, task / files / last error under 0.95: " + ("; ".join(low) if low else "none") + ".\n")


def cost_targets(results: list[RunResult]) -> str:
    """The compaction-cost targets (the section says them), per dialect and limit."""
    def mark(ok: bool) -> str:
        return "" if ok else " **missed**"

    rows = []
    for ratio, d, ok in cells(results):
        scored = [s for _, s in ok]
        f = pooled([s[STAND_IN] for s in scored])
        drop = pooled([s["drop-oldest"] for s in scored])
        turns = max(1, sum(s[STAND_IN].turns for s in scored))
        least = 100 * sum(r.least_points[ratio] for r, _ in ok) / turns
        at_limit = 100 * sum(r.least_points_at_limit[ratio] for r, _ in ok) / turns
        points, per_point, per_100 = f["points"] or 0.0, f["per_point"] or 0.0, f["summaries_per_100"] or 0.0
        stable, openai, anthropic = f["stable"] or 0.0, f["cost_OpenAI"] or 0.0, f["cost_Anthropic"] or 0.0
        if ratio == 0.50:
            figures = [f"{points:.1f}{mark(points <= 12.5)}", f"{per_point:.2f}{mark(per_point <= 1.0)}",
                     f"{per_100:.1f}", f"{pct(stable)}{mark(stable >= 0.85)}",
                     f"{openai:.3f}{mark(openai <= 0.8)}", f"{anthropic:.3f}{mark(anthropic <= 1.0)}"]
        else:
            figures = [f"{points:.1f}", f"{per_point:.2f}", f"{per_100:.1f}{mark(per_100 <= 20)}",
                     f"{pct(stable)} vs {pct(drop['stable'])}{mark(stable > (drop['stable'] or 0.0))}",
                     f"{openai:.3f}{mark(openai <= 0.55)}", f"{anthropic:.3f}"]
        rows.append([f"{d} at {ratio:.0%} ({len(scored)})", f"{least:.1f}", f"{at_limit:.1f}", *figures])
    return ("### Compaction cost: the targets\n\nAt 50%: ≤ 12.5 points / 100 turns, ≤ 1 summary / point, prefix-stable "
            "≥ 85%, cost ≤ 0.8 (OpenAI) and ≤ 1.0 (Anthropic). At 25%: ≤ 20 summaries / 100 turns, prefix-stable "
            "ahead of drop-oldest, cost ≤ 0.55 (OpenAI). **missed** marks a target not met. *At best*: the fewest "
            "points any compactor needs under the same trigger, each landing at the run's floor (system prompt, "
            "task, tools schema) and so absorbing at most (trigger − floor) of the growth past the trigger; "
            "*at the limit*: the same with the limit itself as the trigger, the fewest points any compactor that "
            "keeps the system prompt, the task and the tools schema needs (ctxgate may wait past its trigger, "
            "so it can come in under the first).\n\n"
            + common.table(["dialect at limit (runs)", "points / 100 turns at best",
                            "points / 100 turns at best, at the limit", "points / 100 turns",
                            "summaries / point",
                            "summaries / 100 turns", "prefix-stable", "cost (OpenAI)", "cost (Anthropic)"], rows)
            + "\n")


def long_section(results: list[RunResult]) -> str:
    """Each long session on its own row, at both limits: the targets' figures and the probes,
    ctxgate (stand-in) with drop-oldest's prefix stability and cost beside it."""
    rows = []
    for ratio in RATIOS:
        for r in results:
            scores = r.scores[ratio]
            if scores is None:
                continue
            ours, drop = scores[STAND_IN], scores["drop-oldest"]
            f = pooled([ours])
            least = 100 * r.least_points[ratio] / max(1, ours.turns)
            rows.append([f"{r.name} at {ratio:.0%}", str(ours.turns), f"{least:.1f}",
                         fmt(f["points"], 1), fmt(f["per_point"], 2), f"{pct(ours.stable)} vs {pct(drop.stable)}",
                         f"{fmt(ours.cost['OpenAI'])} vs {fmt(drop.cost['OpenAI'])}",
                         f"{fmt(ours.cost['Anthropic'])} vs {fmt(drop.cost['Anthropic'])}",
                         *(fmt(ours.probes[k]) for k in ("task", "files", "error", "latest")),
                         pct(ours.refused_ctxgate + ours.refused_upstream)])
    return ("### Long sessions: a source's runs back to back\n\nThe targets are about sessions that run well past "
            "their limit. Per source, its runs joined into one session (the first whole, each later run without its "
            f"own system prompt, as the next task of the same session; up to {LONG_TOKENS:,} tokens; runs with "
            "another tools schema left out), replayed the same way at 50% and 25% of the session's final size. "
            "ctxgate with the stand-in summary; drop-oldest's prefix stability and cost beside it.\n\n"
            + common.table(["session at limit", "turns", "points / 100 turns at best", "points / 100 turns",
                            "summaries / point", "prefix-stable vs drop-oldest", "cost (OpenAI) vs drop-oldest",
                            "cost (Anthropic) vs drop-oldest", "task", "files", "last error", "last 6", "refused"],
                           rows) + "\n")


def limits_section(results: list[RunResult]) -> str:
    """Issue 36's targets for the newest messages and refusals beside what the limit allows."""
    rows = []
    for ratio, d, ok in cells(results):
        bounds = [r.allowed[ratio] for r, _ in ok]
        f = pooled([s[STAND_IN] for _, s in ok])
        drop = pooled([s["drop-oldest"] for _, s in ok])
        turns = sum(s[STAND_IN].turns for _, s in ok)
        aim = 0.94 if ratio == 0.50 else 0.90
        best = sum(b.latest for b in bounds) / len(bounds)
        rows.append([f"{d} at {ratio:.0%} ({len(ok)})", f"{aim:.2f}", fmt(best), fmt(f["latest"]), fmt(drop["latest"]),
                     f"{sum(b.short > 0 for b in bounds)} / {sum(b.short for b in bounds)}",
                     f"{sum(b.unservable > 0 for b in bounds)} / {sum(b.unservable for b in bounds)} of {turns}",
                     f"{sum(b.over_budget > 0 for b in bounds)} / {sum(b.over_budget for b in bounds)}",
                     pct(f["refused"]), pct(drop["refused"])])
    return ("### What the limits allow: the newest messages and refusals\n\nA compactor that keeps the system "
            f"prompt, the task statement and the tools schema can keep at best as many of the newest {LATEST} "
            "messages whole as fit beside them within the limit (the smallest first, the others cut or dropped): "
            "*last 6 at best* is that share, per turn, averaged as the probe is (an upper bound: ctxgate forwards "
            "within the effective budget, 95% of the limit, unless those alone are over it, issue 36 item 8; "
            "drop-oldest keeps no task and may pass it). "
            f"*Runs / turns short*: runs with a turn, and turns, where not all the newest {LATEST} fit. "
            "*Unservable*: turns where not even the last message fits beside them (an observation cut to "
            "Microcompact's least): every such compactor refuses them. *Over the budget only*: turns where that "
            "fits the limit but not the effective budget; ctxgate refuses these too (its count may be off by the "
            "margin: issue 36 item 8), drop-oldest does not (it keeps no task, and its upstream counts as it does)."
            "\n\n"
            + common.table(["dialect at limit (runs)", "target last 6", "last 6 at best", "ctxgate last 6",
                            "drop-oldest last 6", "runs / turns short", "runs / turns unservable",
                            "runs / turns over the budget only", "ctxgate refused", "drop-oldest refused"],
                           rows) + "\n")


def report(results: list[RunResult], long: list[RunResult], elapsed: float, note: str) -> str:
    header = common.section_header("Recoverability per dialect: multi-turn replay, the upstream enforcing the limit")
    out = [header.rstrip("\n") + f"\n- wall time {elapsed:.0f}s{note}\n"]
    out.append(" ".join(common.about(__doc__).split()) + "\n")
    count = collections.Counter(r.dialect for r in results)
    out.append("Runs: " + ", ".join(f"{d} {count[d]}" for d in DIALECTS if count[d]) + ".\n")
    out.append("### ctxgate (stand-in summary) against the best baseline, per probe\n")
    out.append(scoreboard(results) + "\n")
    out.append(aims(results))
    out.append(cost_targets(results))
    out.append(limits_section(results))
    if long:
        out.append(long_section(long))
    for ratio in RATIOS:
        out.append(f"### Limit {ratio:.0%} of the final size\n")
        out += [dialect_section(results, d, ratio) for d in DIALECTS if count[d]]
    return "\n".join(out)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--limit", type=int, default=None, help="at most N runs per dialect")
    p.add_argument("--turns", default=None, metavar="FILE",
                   help="also write ctxgate's (stand-in) turns with their probes here, one JSON object a line")
    p.add_argument("--only", default=None, help="one dialect: 'tool calls', 'OpenHands text', 'SWE-agent text' or "
                                                "'mini-swe-agent' (case and dashes ignored)")
    args = p.parse_args()

    counter = common.gpt4o_counter()
    chosen = runs(args.only, args.limit)
    if not chosen:
        sys.exit(f"no runs for --only {args.only!r} (dialects: {', '.join(DIALECTS)})")
    loop = asyncio.new_event_loop()
    started = time.perf_counter()
    results = []
    turns_out = open(args.turns, "wb") if args.turns else None

    def per_turn(record: dict[str, Any]) -> None:
        if turns_out is not None:
            turns_out.write(orjson.dumps(record) + b"\n")

    for k, (name, t, dialect, msgs) in enumerate(chosen):
        t0 = time.perf_counter()
        result = evaluate(name, t, dialect, msgs, counter, loop, per_turn)
        results.append(result)
        half = result.scores[RATIOS[0]]
        ours = half[STAND_IN] if half is not None else None
        brief = ("system prompt + task over the limit" if ours is None else
                 f"task {fmt(ours.probes['task'], 2)}, refused {pct(ours.refused_ctxgate + ours.refused_upstream)}")
        print(f"[{k + 1}/{len(chosen)}] {dialect}: {name[:70]} ({len(agent_turns(msgs))} turns, "
              f"{time.perf_counter() - t0:.1f}s; ctxgate at 50%: {brief})", file=sys.stderr, flush=True)
    long = []
    for name, t, dialect, msgs in long_sessions(chosen, counter):
        t0 = time.perf_counter()
        long.append(evaluate(name, t, dialect, msgs, counter, loop, per_turn))
        print(f"[long] {name} ({len(agent_turns(msgs))} turns, {time.perf_counter() - t0:.1f}s)", file=sys.stderr,
              flush=True)
    if turns_out is not None:
        turns_out.close()
    note = "" if args.limit is None and args.only is None else (
        f" (a partial run: --limit {args.limit}, --only {args.only})")
    markdown = report(results, long, time.perf_counter() - started, note)
    common.publish("dialects", markdown, args.out)


if __name__ == "__main__":
    main()
