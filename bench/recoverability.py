"""Recoverability: what a continuing agent still finds in the compressed request.

Every recorded run (tests/trajectories.py: every_dialect — the tool-call runs, SWE-agent,
and the text-protocol OpenHands and mini-swe-agent runs), as bench/common.py: request_ready
makes it (the request its agent would send for its next step), is compressed to 50% and
25% of its own token size by:

- ctxgate: build_pipeline(PipelineConfig(), summarize=scripted_summary,
  working_state=extract_working_state(messages, config.restore),
  effective_budget=budget / target_ratio) then .compact(CompressionRequest(messages, budget,
  counter)) — the chain as proxy/compaction.py runs it: the proxy compacts to
  target_ratio (0.50) of the effective budget, so a budget B means an effective budget 2B
  (Microcompact's per-output cap of 5% and the restore allowance of 10% are shares of it;
  restore blocks are carved out of B).
- ctxgate, no summarizer: the same with summarize=None (Autocompact cannot run), to show
  how much the scores owe to the stand-in summary.
- litellm.utils.trim_messages(messages, model="gpt-4o", max_tokens=budget)
- langchain_core.messages.trim_messages(convert_to_messages(messages), max_tokens=budget,
  token_counter=<the same o200k counter>, strategy="last", include_system=True,
  start_on=...), back through convert_to_openai_messages. start_on="human", except for
  tool-calling coding agents (OpenHands, function-calling SWE-agent), whose only user
  messages are the task and a few nudges: there start_on=("human", "ai"), else the window
  would begin at the last nudge or keep nothing.
- drop-oldest: keep the leading system message, drop the oldest other messages one by
  one until the request fits.

THE SUMMARY IS SCRIPTED, NOT AN LLM. `scripted_summary` is a deterministic function of the
prompt Autocompact sends (the serialised span): it writes the six fields from what it can
parse — 1. the first user message's first 300 characters, 2. the number of messages and
the tools called, 3. the last assistant remark (200 chars), 4. the last line mentioning an
error, 5. every file path it sees (newest first), 6. the tool names. A real model would
write a better prose summary and might list fewer paths; treat the ctxgate figures as
"the chain with a competent summariser", and the no-summarizer row as its floor.

Scores (per trajectory and budget; a score is left out of a mean when it does not apply):
- task: the task statement's text is in some output message, or ≥ 90% of its first 500
  characters (20 pieces of 25, whitespace collapsed) are in one output message; the task
  statement is the first user message, or, when that is a SWE-agent demonstration of
  another task ("Here is a demonstration…"), the user message after it;
- files: share of the files the agent touched (paths in tool-call arguments, in SWE-agent
  command blocks, and in `[File: …]` / `(Open file: …)` observation headers) that appear
  anywhere in the output; n/a when the run touched no file;
- last error: the key line (last line containing "Error", "Traceback" or "error:") of the
  last tool/observation text with one is present; n/a when there is none;
- latest: share of the last 3 input messages present unchanged in the output;
- valid: tool calls and results paired (ctxgate.pipeline.turns.is_valid_sequence) and the
  leading system message kept unchanged;
- within budget: count_messages(output) ≤ budget (o200k_base, OpenAI's message formula);
- cut line (its own table, not in *all scores 1*): one observation line ctxgate's output lost,
  found in the output or, for ctxgate, brought back through the expansion tool within its
  limits (bench/expansion_probe.py says how the line is picked and the model simulated).

Runs of a text dialect (dialect_of(run) is not "tool calls") are scored in text mode: their
observations are the user turns after the task, their actions the command blocks or
`<function=…>` blocks of the assistant text.

Cases where the system prompt + task alone exceed the budget cannot be met by any method;
they are reported separately. Results overall, by source, and per dialect × method.

    .venv/bin/python bench/recoverability.py
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (sets LITELLM_LOCAL_MODEL_COST_MAP first)

from ctxgate.pipeline.chain import build_pipeline  # noqa: E402
from ctxgate.pipeline.config import PipelineConfig  # noqa: E402
from ctxgate.pipeline.restore import extract_working_state  # noqa: E402
from ctxgate.pipeline.turns import first_user_index, is_valid_sequence  # noqa: E402
from common import split_units  # noqa: E402  (wherever the package under test keeps it)
from ctxgate.pipeline.request import CompressionRequest  # noqa: E402
from ctxgate.pipeline.config import ExpandConfig  # noqa: E402
from ctxgate.pipeline.refs import CutLog  # noqa: E402
from ctxgate.proxy.engine.expansion import tool_definition  # noqa: E402
import expansion_probe  # noqa: E402
from trajectories import DIALECTS, TOOL_CALLS, dialect_of  # noqa: E402
from ctxgate.proxy.replay.probes import (  # noqa: E402
    last_error_line,
    norm,
    observations,
    task_present,
    task_statement_index,
    text_of,
    touched_files,
)
from dialects import scripted_summary_text  # noqa: E402

Message = dict[str, Any]
RATIOS = (0.50, 0.25)
TIGHT_SUMMARY = 100


def is_text_mode(messages: list[Message]) -> bool:
    return not any(m.get("role") == "tool" for m in messages)


@dataclass
class Needs:
    task: str
    files: list[str]
    error: str | None
    latest: list[tuple]
    system: tuple | None
    demonstration: bool = False
    """The first user message is a SWE-agent demonstration; the task is the user message after it."""


def needs_of(messages: list[Message], text_mode: bool) -> Needs:
    """`text_mode`: observations in user turns (a text dialect)."""
    task = task_statement_index(messages)
    system = norm(messages[0]) if messages and messages[0].get("role") in ("system", "developer") else None
    return Needs(task=text_of(messages[task]) if task is not None else "", files=touched_files(messages, text_mode),
                 error=last_error_line(messages, text_mode), latest=[norm(m) for m in messages[-3:]], system=system,
                 demonstration=task != first_user_index(messages))


@dataclass
class Score:
    task: float
    files: float | None
    error: float | None
    latest: float
    valid: float
    within: float
    tokens: int
    note: str = ""
    pairs: bool = True
    system_kept: bool = True
    cut_line: float | None = None
    """The probe line is in the output, or (ctxgate) brought back by expansion; None: no probe."""
    expansions: int = 0
    """Expansions it took (0: in the output, or not brought back)."""

    def values(self) -> list[float]:
        return [v for v in (self.task, self.files, self.error, self.latest, self.valid, self.within) if v is not None]

    @property
    def mean(self) -> float:
        vals = self.values()
        return sum(vals) / len(vals)


def score(needs: Needs, out: list[Message], budget: int, counter) -> Score:
    blob = "\n\x00\n".join(text_of(m) for m in out)
    outs = {norm(m) for m in out}
    files = (sum(p in blob for p in needs.files) / len(needs.files)) if needs.files else None
    error = (1.0 if needs.error in blob else 0.0) if needs.error else None
    latest = sum(n in outs for n in needs.latest) / len(needs.latest)
    system_kept = needs.system is None or (bool(out) and norm(out[0]) == needs.system)
    pairs = is_valid_sequence(out)
    valid = 1.0 if (pairs and system_kept) else 0.0
    tokens = counter.count_messages(out)
    return Score(task=1.0 if task_present(needs.task, out) else 0.0, files=files, error=error, latest=latest,
                 valid=valid, within=1.0 if tokens <= budget else 0.0, tokens=tokens,
                 pairs=pairs, system_kept=system_kept)


# ---------------------------------------------------------------------------------------

async def scripted_summary(prompt: list[Message]) -> str:
    return scripted_summary_text(prompt)


# ---------------------------------------------------------------------------------------
# Methods


def make_methods(counter) -> dict[str, Callable[[str, list[Message], int], list[Message]]]:
    import litellm
    from langchain_core.messages import convert_to_messages, convert_to_openai_messages, trim_messages

    litellm.suppress_debug_info = True
    logging.getLogger("LiteLLM").setLevel(logging.ERROR)
    loop = asyncio.new_event_loop()
    cfg = PipelineConfig()
    diagnostics: dict[str, Any] = {}

    def ctxgate(summarize):
        def run(source: str, messages: list[Message], budget: int) -> list[Message]:
            # As the proxy runs it: the target is target_ratio (0.5) of the effective budget.
            effective = int(budget / cfg.target_ratio)
            pipe = build_pipeline(cfg, summarize=summarize, working_state=extract_working_state(messages, cfg.restore),
                                  effective_budget=effective)
            cuts = CutLog()
            result = loop.run_until_complete(pipe.compact(CompressionRequest(messages, budget, counter, cuts=cuts)))
            diagnostics["last"] = result
            diagnostics["expandable"] = (cuts.originals, effective)
            return result.compressed_messages
        return run

    def litellm_trim(source: str, messages: list[Message], budget: int) -> list[Message]:
        with contextlib.redirect_stdout(io.StringIO()):
            return litellm.utils.trim_messages(messages, model="gpt-4o", max_tokens=budget)

    def lc_counter(msgs) -> int:
        return counter.count_messages(convert_to_openai_messages(list(msgs)))

    def langchain(source: str, messages: list[Message], budget: int) -> list[Message]:
        start_on: Any = "human"
        if source == "swe-gym-openhands" or (source == "swe-agent" and not is_text_mode(messages)):
            start_on = ("human", "ai")
        kept = trim_messages(convert_to_messages(messages), max_tokens=budget, token_counter=lc_counter,
                             strategy="last", include_system=True, start_on=start_on, allow_partial=False)
        return convert_to_openai_messages(kept)

    def drop_oldest(source: str, messages: list[Message], budget: int) -> list[Message]:
        head = 1 if messages and messages[0].get("role") in ("system", "developer") else 0
        out = list(messages)
        while counter.count_messages(out) > budget and len(out) > head:
            out.pop(head)
        return out

    methods = {
        "ctxgate": ctxgate(scripted_summary),
        "ctxgate, no summarizer": ctxgate(None),
        "litellm trim_messages": litellm_trim,
        "langchain trim_messages": langchain,
        "drop-oldest": drop_oldest,
    }
    methods["_diagnostics"] = diagnostics  # type: ignore[assignment]
    return methods


# ---------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    source: str
    ratio: float
    budget: int
    size: int
    floor: int
    core: int = 0
    """system + task + the last unit (the turn in progress, which ctxgate never cuts)."""
    demonstration: bool = False
    scores: dict[str, Score] = field(default_factory=dict)
    ctxgate_levels: str = ""
    ctxgate_fits: bool = True
    ctxgate_hints: list[str] = field(default_factory=list)
    dialect: str = TOOL_CALLS

    @property
    def feasible(self) -> bool:
        return self.floor <= self.budget

    @property
    def tight(self) -> bool:
        """Feasible, but system + task + the last unit + Autocompact's smallest summary
        allowance (100 tokens) are over the budget: only dropping or cutting the turn in
        progress can fit it."""
        return self.feasible and self.core + TIGHT_SUMMARY > self.budget


def probe_cut_line(case: Case, obs: list[Message], outs: dict[str, list[Message]],
                   expandable: dict[str, tuple[dict[str, str], int]], counter) -> None:
    """Score every method on the line ctxgate's output lost (`expansion_probe`)."""
    line = expansion_probe.cut_line(obs, outs.get("ctxgate", []))
    if line is None:
        return
    tool = counter.count_tools([{"type": "function", "function": tool_definition(ExpandConfig())}])
    for meth, out in outs.items():
        s = case.scores[meth]
        if line in "\n".join(text_of(m) for m in out):
            s.cut_line = 1.0
        elif meth in expandable:
            originals, effective = expandable[meth]
            # As the gateway leaves it (`expansion.expansion_room`): up to the compaction trigger.
            room = int(PipelineConfig().trigger_ratio * effective) - counter.count_messages(out) - tool
            n = asyncio.run(expansion_probe.expansions_to_reach(line, out, dict(originals), room, counter))
            s.cut_line, s.expansions = (1.0, n) if n else (0.0, 0)
        else:
            s.cut_line = 0.0


def cut_line_table(cases: list[Case], names: list[str]) -> str:
    rows = []
    for ratio in RATIOS:
        for meth in names:
            sc = [c.scores[meth] for c in cases if c.ratio == ratio and c.feasible]
            probed = [s for s in sc if s.cut_line is not None]
            if not probed:
                continue
            by = collections.Counter(s.expansions for s in probed if s.cut_line)
            rows.append([f"{ratio:.0%}", meth, len(probed), fmt_mean([s.cut_line for s in probed]),
                         by.get(0, 0), by.get(1, 0), by.get(2, 0), by.get(3, 0)])
    return common.table(["budget", "method", "probes", "cut line answered", "in the output", "after 1 expansion",
                         "after 2", "after 3"], rows, "llrrrrrr")


def fmt_mean(vals: list[float]) -> str:
    return f"{sum(vals) / len(vals):.3f}" if vals else "n/a"


def method_table(cases: list[Case], methods: list[str]) -> str:
    rows = []
    for meth in methods:
        sc = [c.scores[meth] for c in cases]
        files = [s.files for s in sc if s.files is not None]
        errors = [s.error for s in sc if s.error is not None]
        allok = [1.0 if all(v == 1.0 for v in s.values()) else 0.0 for s in sc]
        usage = [s.tokens / c.budget for s, c in zip(sc, cases)]
        rows.append([meth, fmt_mean([s.task for s in sc]), f"{fmt_mean(files)} (n={len(files)})",
                     f"{fmt_mean(errors)} (n={len(errors)})", fmt_mean([s.latest for s in sc]),
                     f"{100 * sum(s.valid for s in sc) / len(sc):.1f}% ({100 * sum(s.pairs for s in sc) / len(sc):.0f}%"
                     f" / {100 * sum(s.system_kept for s in sc) / len(sc):.0f}%)",
                     f"{100 * sum(s.within for s in sc) / len(sc):.1f}%", f"{100 * sum(allok) / len(allok):.1f}%",
                     f"{sum(usage) / len(usage):.2f}"])
    return common.table(["method", "task", "files touched", "last error", "latest 3",
                         "valid request (pairs / system kept)", "within budget", "all scores 1", "tokens / budget"],
                        rows)


DIALECT_METHODS = ("ctxgate", "ctxgate, no summarizer", "drop-oldest", "langchain trim_messages",
                   "litellm trim_messages")


def dialect_tables(cases: list[Case], names: list[str]) -> str:
    """Per ratio, one table of dialect × method over the feasible cases."""
    out = []
    methods = [m for m in DIALECT_METHODS if m in names] + [m for m in names if m not in DIALECT_METHODS]
    for ratio in RATIOS:
        rows = []
        for d in DIALECTS:
            cs = [c for c in cases if c.ratio == ratio and c.feasible and c.dialect == d]
            for k, meth in enumerate(methods if cs else []):
                sc = [c.scores[meth] for c in cs]
                files = [s.files for s in sc if s.files is not None]
                errs = [s.error for s in sc if s.error is not None]
                label = f"{d} ({len(cs)}; files {len(files)}, error {len(errs)})" if k == 0 else ""
                cut = [s.cut_line for s in sc if s.cut_line is not None]
                rows.append([label, meth, fmt_mean([s.task for s in sc]), fmt_mean(files), fmt_mean(errs),
                             fmt_mean([s.latest for s in sc]), fmt_mean([s.valid for s in sc]),
                             fmt_mean([s.within for s in sc]), f"{fmt_mean(cut)} (n={len(cut)})"])
        out.append(f"### Per dialect at {ratio:.0%} — feasible cases\n")
        out.append(common.table(["dialect (cases; n files, n error)", "method", "task", "files", "last error",
                                 "latest 3", "valid", "within budget", "cut line"], rows, "llrrrrrrr") + "\n")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description="recoverability of compressed requests, ctxgate vs baselines")
    p.add_argument("--limit", type=int, default=None, help="only the first N trajectories (for a quick look)")
    args = p.parse_args()

    counter = common.gpt4o_counter()
    trajectories = common.named_trajectories(every=True)[: args.limit]
    methods = make_methods(counter)
    diagnostics = methods.pop("_diagnostics")
    names = list(methods)
    cases: list[Case] = []
    errors: list[str] = []
    timing = collections.defaultdict(float)
    started = time.perf_counter()
    common.progress(f"recoverability: {len(trajectories)} trajectories × {len(RATIOS)} budgets × {len(names)} methods")
    for k, (name, traj, messages) in enumerate(trajectories):
        dialect = dialect_of(traj)
        needs = needs_of(messages, text_mode=dialect != TOOL_CALLS)
        size = counter.count_messages(messages)
        fu = task_statement_index(messages)
        floor_msgs = [m for i, m in enumerate(messages) if i == fu or (i == 0 and m.get("role") == "system")]
        floor = counter.count_messages(floor_msgs)
        last = split_units(messages)[-1]
        core = counter.count_messages(floor_msgs + [m for i, m in enumerate(messages[last.start:last.end], last.start)
                                                    if i != fu])
        for ratio in RATIOS:
            budget = int(size * ratio)
            case = Case(name, traj.source, ratio, budget, size, floor, core, needs.demonstration, dialect=dialect)
            outs: dict[str, list[Message]] = {}
            expandable: dict[str, tuple[dict[str, str], int]] = {}
            for meth in names:
                t0 = time.perf_counter()
                try:
                    out = outs[meth] = methods[meth](traj.source, messages, budget)
                    case.scores[meth] = score(needs, out, budget, counter)
                except Exception as e:  # a method that fails sends nothing usable
                    errors.append(f"{meth} on {name} @ {ratio:.0%}: {type(e).__name__}: {str(e)[:200]}")
                    case.scores[meth] = Score(0.0, 0.0 if needs.files else None, 0.0 if needs.error else None,
                                              0.0, 0.0, 0.0, 0, note=f"{type(e).__name__}")
                timing[meth] += time.perf_counter() - t0
                if meth == "ctxgate" and "last" in diagnostics:
                    r = diagnostics.pop("last")
                    case.ctxgate_levels = ",".join(dict.fromkeys(s.level.value for s in r.steps)) or "none"
                    case.ctxgate_fits = r.fits
                    case.ctxgate_hints = list(r.recovery_hints)
                diagnostics.pop("last", None)
                if "expandable" in diagnostics:
                    expandable[meth] = diagnostics.pop("expandable")
            probe_cut_line(case, observations(messages, dialect != TOOL_CALLS), outs, expandable, counter)
            cases.append(case)
        if (k + 1) % 25 == 0 or k + 1 == len(trajectories):
            common.progress(f"  {k + 1}/{len(trajectories)} trajectories ({time.perf_counter() - started:.1f}s)")
    write(cases, names, errors, timing, len(trajectories))


def write(cases: list[Case], names: list[str], errors: list[str], timing: dict[str, float], n_traj: int) -> None:
    out = [common.section_header("Recoverability: ctxgate vs trimming baselines on the recorded trajectories"), ""]
    runs = {c.name: c for c in cases}.values()
    by_dialect, by_source = collections.Counter(c.dialect for c in runs), collections.Counter(c.source for c in runs)
    out.append(
        f"{n_traj} recorded runs ({', '.join(f'{s}: {n}' for s, n in by_source.items())}"
        f"; by dialect: {', '.join(f'{d} {by_dialect[d]}' for d in DIALECTS if by_dialect[d])}), "
        "text dialects scored in text mode (observations in user turns), each as the request its agent would "
        "send next (`bench/common.py: request_ready`: SWE-agent tool results get back the `tool_call_id` the "
        "loader drops, and the recorded final assistant message is not part of the input), compressed to 50% "
        "and 25% of its own size (o200k_base). Methods, scores and the scripted summary are described in "
        "`bench/recoverability.py`'s docstring; in short: **the Autocompact summary is written by a "
        "deterministic script standing in for an LLM** (it quotes the first user message's first 300 characters, "
        "counts the tools called, quotes the last assistant remark and the last error line, and lists every file "
        "path it sees), and `ctxgate, no summarizer` is the same chain with no summary model at all. Budgets are "
        "for the messages only (the OpenHands `tools` schema is not counted). Means over the cases where a score "
        "applies (n = how many); *valid request* = tool calls/results paired and the leading system message "
        "kept; *all scores 1* = every applicable score is 1; *tokens / budget* = mean of output tokens ÷ budget. "
        "For ctxgate the budget here is its compaction *target* (half its effective budget): it keeps the "
        "recent window (the newest 10 messages, at least two steps) whole even when that lands it over the "
        "target, and only gives the window up over the whole effective budget (the gateway's `run_chain`, "
        "not run here), so *within budget* understates what reaches a provider; the multi-turn replay "
        "(`bench/dialects.py`, below) measures against the provider's limit.\n")
    for ratio in RATIOS:
        feas = [c for c in cases if c.ratio == ratio and c.feasible]
        infeas = [c for c in cases if c.ratio == ratio and not c.feasible]
        out.append(f"### Budget {ratio:.0%} of the trajectory's size — {len(feas)} cases that can fit\n")
        out.append(method_table(feas, names) + "\n")
        tight = [c for c in feas if c.tight]
        if tight:
            loose = [c for c in feas if not c.tight]
            by_src = collections.Counter(c.source for c in tight)
            out.append(f"Of these, {len(tight)} are *tight* ({', '.join(f'{s}: {n}' for s, n in by_src.items())}): "
                       f"system prompt + task + the last message(s) (the turn in progress, a tool call with its "
                       f"results or the newest user message) + {TIGHT_SUMMARY} tokens for the smallest Autocompact "
                       f"summary exceed the budget, so only a method that drops or cuts the turn in progress can "
                       f"fit. The other {len(loose)}:\n")
            out.append(method_table(loose, names) + "\n")
        if infeas:
            by_src = collections.Counter(c.source for c in infeas)
            out.append(f"{len(infeas)} more cases at {ratio:.0%} have a system prompt + task larger than the "
                       f"budget, so no method can fit them ({', '.join(f'{s}: {n}' for s, n in by_src.items())}); "
                       f"their scores, for the record:\n")
            out.append(method_table(infeas, names) + "\n")
    out.append(dialect_tables(cases, names))
    out.append("### A line that was cut, answered through expansion (feasible cases)\n")
    out.append("One line per case that ctxgate's compressed request lost (an observation line of 20+ characters, "
               "unique in the run, picked by hash; `bench/expansion_probe.py`). A baseline answers it when the line "
               "is in its output; ctxgate when a model asking its expansion tool gets it back within the gateway's "
               "limits (3 expansions, the room left under the compaction trigger, excerpts naming what they "
               "leave out), the "
               "model simulated as one that asks for the reference whose original holds the line.\n")
    out.append(cut_line_table(cases, names) + "\n")
    # ctxgate by source
    rows = []
    for ratio in RATIOS:
        for src in dict.fromkeys(c.source for c in cases):
            cs = [c for c in cases if c.ratio == ratio and c.feasible and c.source == src]
            if not cs:
                continue
            sc = [c.scores["ctxgate"] for c in cs]
            files = [s.files for s in sc if s.files is not None]
            errs = [s.error for s in sc if s.error is not None]
            levels = collections.Counter(c.ctxgate_levels for c in cs)
            rows.append([f"{ratio:.0%}", src, f"{len(cs)} ({sum(c.tight for c in cs)})", fmt_mean([s.task for s in sc]),
                         fmt_mean(files),
                         fmt_mean(errs), fmt_mean([s.latest for s in sc]), fmt_mean([s.valid for s in sc]),
                         fmt_mean([s.within for s in sc]),
                         "; ".join(f"{lv}: {n}" for lv, n in levels.most_common(4))])
    out.append("### ctxgate by source (feasible cases)\n")
    out.append(common.table(["budget", "source", "cases (tight)", "task", "files", "last error", "latest 3", "valid",
                             "within", "levels used (cases)"], rows, "llrrrrrrrl") + "\n")
    not_fit = [c for c in cases if c.feasible and not c.ctxgate_fits]
    if not_fit:
        out.append(f"ctxgate's chain returned `fits=False` on {len(not_fit)} feasible case(s) (the proxy would "
                   "answer `context_exhausted` instead of sending): "
                   + "; ".join(f"{common.short_name(c.name, 50)} @ {c.ratio:.0%} ({c.scores['ctxgate'].tokens:,} "
                               f"of {c.budget:,} tokens)" for c in not_fit[:12])
                   + (" …" if len(not_fit) > 12 else "") + "\n")
    demo_runs = len({c.name for c in cases if c.demonstration})
    if demo_runs:
        out.append(f"**Demonstrations.** In {demo_runs} SWE-agent runs the first user message is a demonstration of "
                   "another task; their *task* score is for the issue statement after it (the task to solve).\n")
    # weakest
    feas = [c for c in cases if c.feasible]
    weakest = sorted(feas, key=lambda c: (c.scores["ctxgate"].mean, c.name))[:10]
    weakest += sorted([c for c in feas if not c.tight and c not in weakest],
                      key=lambda c: (c.scores["ctxgate"].mean, c.name))[:10]
    rows = []
    for c in weakest:
        s = c.scores["ctxgate"]
        show = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append([common.short_name(c.name, 58) + (" (tight)" if c.tight else ""), f"{c.ratio:.0%}",
                     f"{c.budget:,}", show(s.task), show(s.files),
                     show(s.error), show(s.latest), show(s.valid), show(s.within), f"{s.tokens:,}",
                     c.ctxgate_levels, "; ".join(h for h in c.ctxgate_hints if "only the last" in h or "failed" in h
                                                 or "off" in h)[:90] or "—"])
    out.append("### Weakest cases for ctxgate (lowest mean of its applicable scores): the 10 weakest feasible "
               "cases, then the 10 weakest that are not tight\n")
    out.append(common.table(["trajectory", "budget", "tokens", "task", "files", "error", "latest", "valid", "within",
                             "sent", "levels", "hints"], rows, "lrrrrrrrrrll") + "\n")
    out.append("Time spent per method over the whole run: "
               + ", ".join(f"{m} {t:.1f}s" for m, t in timing.items()) + ".\n")
    if errors:
        out.append(f"Exceptions ({len(errors)}), scored 0:\n\n" + "\n".join(f"- {e}" for e in errors[:20]) + "\n")
    else:
        out.append("No method raised an exception.\n")
    common.write_section("recoverability", "\n".join(out))
    common.progress(f"recoverability: wrote {common.RESULTS.relative_to(common.ROOT)}")
    for ratio in RATIOS:
        feas = [c for c in cases if c.ratio == ratio and c.feasible]
        for meth in names:
            sc = [c.scores[meth] for c in feas]
            common.progress(f"  {ratio:.0%} {meth:26s} mean score {sum(s.mean for s in sc) / len(sc):.3f}, "
                            f"valid {100 * sum(s.valid for s in sc) / len(sc):.0f}%, "
                            f"within {100 * sum(s.within for s in sc) / len(sc):.0f}%")


if __name__ == "__main__":
    main()
