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

Per door (`--doors`, its own section): every tool-call run goes through three doors, each
written in the door's wire format (bench/doors.py: `to_anthropic`, `to_responses`), read into
the neutral model by the door's own code (`messages_model.conversation_of`,
`responses_model.to_messages`), compressed by the "ctxgate" method above to 50% / 25% of that
door's own neutral size, and written back by the door (`render`, `to_request`). Scores, in the
door's own terms (the definitions above otherwise):
- task, files, last error: the text of the rendered request (Messages: `system` and every
  block's text, `tool_use` as name + JSON input, `tool_result` content; Responses:
  `instructions` and every item's text, call name + arguments, outputs);
- latest 3: share of the last 3 input units present unchanged (chat: messages; Messages:
  turns; Responses: `input` items);
- valid: chat: tool calls and results paired; Messages: the turns alternate and start with a
  user turn, every `tool_result` answers a `tool_use` of the turn before and every `tool_use`
  (but in the last turn) is answered in the next; Responses: every `function_call_output`
  follows its `function_call`, and every call has an output; and the client's system prompt /
  instructions kept;
- within budget: the rendered request, read back through the door, counts <= the budget.

    .venv/bin/python bench/recoverability.py [--limit N] [--doors] [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (sets LITELLM_LOCAL_MODEL_COST_MAP first)
import doors  # noqa: E402

from ctxgate.pipeline.chain import build_pipeline  # noqa: E402
from ctxgate.pipeline.config import PipelineConfig  # noqa: E402
from ctxgate.pipeline.restore import extract_working_state  # noqa: E402
from ctxgate.pipeline.turns import first_user_index, is_valid_sequence  # noqa: E402
from common import split_units  # noqa: E402  (wherever the package under test keeps it)
from ctxgate.pipeline.request import CompressionRequest  # noqa: E402
from ctxgate.pipeline.config import ExpandConfig  # noqa: E402
from ctxgate.pipeline.refs import CutLog  # noqa: E402
from ctxgate.pipeline.tokens import TokenCounter  # noqa: E402
from ctxgate.proxy.doors.messages_model import conversation_of, render  # noqa: E402
from ctxgate.proxy.doors.responses_model import input_items, to_messages, to_request  # noqa: E402
from ctxgate.proxy.engine.expansion import tool_definition  # noqa: E402
import expansion_probe  # noqa: E402
from trajectories import DIALECTS, TOOL_CALLS, dialect_of  # noqa: E402
from ctxgate.proxy.replay.probes import (  # noqa: E402
    floor_of,
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
    p = common.parser(__doc__)
    p.add_argument("--limit", type=int, default=None, help="only the first N trajectories (for a quick look)")
    p.add_argument("--doors", action="store_true", help="the tool-call runs through each door (its own section)")
    args = p.parse_args()

    counter = common.gpt4o_counter()
    methods = make_methods(counter)
    if args.doors:
        return run_doors(args, counter, methods)
    trajectories = common.named_trajectories(every=True)[: args.limit]
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
    write(cases, names, errors, timing, len(trajectories), args.out)


def write(cases: list[Case], names: list[str], errors: list[str], timing: dict[str, float], n_traj: int,
          out_file: str | None) -> None:
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
    common.publish("recoverability", "\n".join(out), out_file)
    for ratio in RATIOS:
        feas = [c for c in cases if c.ratio == ratio and c.feasible]
        for meth in names:
            sc = [c.scores[meth] for c in feas]
            common.progress(f"  {ratio:.0%} {meth:26s} mean score {sum(s.mean for s in sc) / len(sc):.3f}, "
                            f"valid {100 * sum(s.valid for s in sc) / len(sc):.0f}%, "
                            f"within {100 * sum(s.within for s in sc) / len(sc):.0f}%")



# ---------------------------------------------------------------------------------------
# Per door (`--doors`)

DOORS = ("chat", "messages", "responses")
SCORES = ("task", "files", "error", "latest", "valid", "within")
Compress = Callable[[str, list[Message], int], list[Message]]


@dataclass
class Rendered:
    """One door's request after compaction, in the door's own wire terms."""
    units: list[str]
    """The text of each top-level unit (system / instructions first, then turns or items)."""
    latest: float
    problems: list[str]
    system_kept: bool
    neutral: list[Message]
    """The rendered request read back through the door: what is counted."""
    levels: str = ""


@dataclass
class DoorCase:
    name: str
    source: str
    ratio: float
    feasible: bool
    scores: dict[str, Score] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=dict)
    levels: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# Text of the rendered units


def _block_text(block: Any) -> str:
    if not isinstance(block, dict):
        return str(block)
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_use":
        return f"{block.get('name', '')}({json.dumps(block.get('input', {}), ensure_ascii=False)})"
    if kind == "tool_result":
        content = block.get("content")
        return content if isinstance(content, str) else "\n".join(_block_text(b) for b in content or [])
    return json.dumps(block, ensure_ascii=False)


def _anthropic_text(content: Any) -> str:
    return content if isinstance(content, str) else "\n".join(_block_text(b) for b in content or [])


def _item_text(item: Message) -> str:
    kind = item.get("type")
    if kind == "function_call":
        return f"{item.get('name', '')}({item.get('arguments', '')})"
    if kind == "function_call_output":
        output = item.get("output")
        return output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "\n".join(str(p.get("text", "")) for p in content or [] if isinstance(p, dict))


# ---------------------------------------------------------------------------------------
# One run through each door


# ---------------------------------------------------------------------------------------
# Validity in each door's API's terms (the rendered shape, which bench/doors.py's checks do not read)


def anthropic_problems(system: Any, turns: list[Message], client_system: str | None) -> tuple[list[str], bool]:
    out: list[str] = []
    if not turns or turns[0].get("role") != "user":
        out.append("does not start with a user turn")
    for i, turn in enumerate(turns):
        if i and turn.get("role") == turns[i - 1].get("role"):
            out.append(f"turn {i}: two {turn.get('role')} turns in a row")
        blocks = turn["content"] if isinstance(turn.get("content"), list) else []
        if turn.get("role") == "user":
            asked = _ids(turns[i - 1], "tool_use", "id") if i and turns[i - 1].get("role") == "assistant" else set()
            stray = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"
                     and b.get("tool_use_id") not in asked]
            if stray:
                out.append(f"turn {i}: tool_result without a tool_use in the turn before: {stray}")
        elif i + 1 < len(turns):
            unanswered = _ids(turn, "tool_use", "id") - _ids(turns[i + 1], "tool_result", "tool_use_id")
            if unanswered:
                out.append(f"turn {i}: tool_use not answered in the next turn: {sorted(unanswered)}")
    if not client_system:
        return out, True
    first = system if isinstance(system, str) else (
        system[0].get("text") if isinstance(system, list) and system and isinstance(system[0], dict) else None)
    return out, first == client_system


def _ids(turn: Message, kind: str, key: str) -> set[Any]:
    content = turn.get("content")
    return {b.get(key) for b in content if isinstance(b, dict) and b.get("type") == kind} \
        if isinstance(content, list) else set()


def responses_problems(items: list[Message]) -> list[str]:
    out: list[str] = []
    called: set[Any] = set()
    answered: set[Any] = set()
    for i, item in enumerate(items):
        if item.get("type") == "function_call":
            called.add(item.get("call_id"))
        elif item.get("type") == "function_call_output":
            if item.get("call_id") not in called:
                out.append(f"item {i}: function_call_output {item.get('call_id')} without its function_call before")
            answered.add(item.get("call_id"))
    if called - answered:
        out.append(f"function_call never answered: {sorted(map(str, called - answered))}")
    return out


def through_messages(messages: list[Message], compress: Compress, source: str, ratio: float,
                     counter: TokenCounter) -> tuple[int, int, Rendered]:
    body = doors.to_anthropic(messages)
    conversation = conversation_of(body)
    size = counter.count_messages(conversation.neutral)
    budget = int(size * ratio)
    system, turns = render(conversation, compress(source, conversation.neutral, budget))
    rendered = {**body, "messages": turns}
    rendered.pop("system", None)
    if system:
        rendered["system"] = system
    problems, kept = anthropic_problems(system, turns, body.get("system"))
    latest = body["messages"][-3:]
    system_units = [system] if isinstance(system, str) else [_anthropic_text(system or [])]
    return size, budget, Rendered(
        units=system_units + [_anthropic_text(t.get("content")) for t in turns],
        latest=sum(m in turns for m in latest) / len(latest), problems=problems, system_kept=kept,
        neutral=conversation_of(rendered).neutral)


def through_responses(messages: list[Message], compress: Compress, source: str, ratio: float,
                      counter: TokenCounter) -> tuple[int, int, Rendered]:
    body = doors.to_responses(messages)
    neutral = to_messages(body.get("instructions"), input_items(body))
    size = counter.count_messages(neutral)
    budget = int(size * ratio)
    instructions, items = to_request(compress(source, neutral, budget))
    latest = body["input"][-3:]
    return size, budget, Rendered(
        units=[instructions or ""] + [_item_text(i) for i in items],
        latest=sum(i in items for i in latest) / len(latest), problems=responses_problems(items),
        system_kept=instructions == body.get("instructions"), neutral=to_messages(instructions, items))


def door_score(needs: Needs, r: Rendered, budget: int, counter: TokenCounter) -> Score:
    blob = "\n\x00\n".join(r.units)
    files = (sum(p in blob for p in needs.files) / len(needs.files)) if needs.files else None
    error = (1.0 if needs.error in blob else 0.0) if needs.error else None
    tokens = counter.count_messages(r.neutral)
    pairs = not r.problems
    return Score(task=1.0 if task_present(needs.task, [{"content": u} for u in r.units]) else 0.0,
                     files=files, error=error, latest=r.latest, valid=1.0 if pairs and r.system_kept else 0.0,
                     within=1.0 if tokens <= budget else 0.0, tokens=tokens, pairs=pairs, system_kept=r.system_kept)


# ---------------------------------------------------------------------------------------
# Report


def _below(case: DoorCase, door: str, key: str) -> bool:
    a, b = getattr(case.scores["chat"], key), getattr(case.scores[door], key)
    return a is not None and b is not None and b < a


def door_table(cases: list[DoorCase]) -> str:
    rows = []
    for door in DOORS:
        sc = [c.scores[door] for c in cases]
        if not sc:
            continue
        files = [s.files for s in sc if s.files is not None]
        errors = [s.error for s in sc if s.error is not None]
        allok = [1.0 if all(v == 1.0 for v in s.values()) else 0.0 for s in sc]
        usage = [s.tokens / (c.sizes[door] * c.ratio) for s, c in zip(sc, cases)]
        means = [s.mean for s in sc]
        rows.append([door, len(sc), fmt_mean([s.task for s in sc]), f"{fmt_mean(files)} (n={len(files)})",
                     f"{fmt_mean(errors)} (n={len(errors)})", fmt_mean([s.latest for s in sc]),
                     f"{100 * sum(s.valid for s in sc) / len(sc):.1f}% ({100 * sum(s.pairs for s in sc) / len(sc):.0f}%"
                     f" / {100 * sum(s.system_kept for s in sc) / len(sc):.0f}%)",
                     f"{100 * sum(s.within for s in sc) / len(sc):.1f}%", f"{100 * sum(allok) / len(allok):.1f}%",
                     f"{sum(usage) / len(usage):.2f}", fmt_mean(means),
                     f"{sum(c.sizes[door] for c in cases) / len(cases):,.0f}"])
    return common.table(["door", "cases", "task", "files touched", "last error", "latest 3",
                         "valid (API rules / system kept)", "within budget", "all scores 1", "tokens / budget",
                         "mean of scores", "mean input tokens"], rows)


def paired_table(cases: list[DoorCase]) -> str:
    """Per door and score, in how many cases it is below / above the chat door's."""
    rows = []
    for door in DOORS[1:]:
        for key in SCORES:
            worse = better = 0
            for c in cases:
                a, b = getattr(c.scores["chat"], key), getattr(c.scores[door], key)
                if a is None or b is None:
                    continue
                worse += b < a
                better += b > a
            rows.append([door, key, worse, better])
    return common.table(["door", "score", "cases below chat", "cases above chat"], rows, "llrr")


def tool_result_inflation(runs: list[tuple[str, Any, list[Message]]], counter: TokenCounter) -> float:
    """Tokens of the Messages door's `tool_result` blocks as the counter counts them (the
    block's JSON) over the tokens of their output text (what a chat `tool` message counts)."""
    as_json = as_text = 0
    for _, _, messages in runs:
        for turn in doors.to_anthropic(messages)["messages"]:
            for block in turn["content"]:
                if block.get("type") == "tool_result":
                    as_json += counter.count_structured({"content": [block]}) - counter.count_structured({})
                    as_text += counter.count(block["content"])
    return as_json / max(1, as_text)


def write_doors(cases: list[DoorCase], n_traj: int, limit: int | None, seconds: float, errors: list[str],
                inflation: float, out_file: str | None) -> None:
    out = [common.section_header("Recoverability per door: chat, Anthropic Messages, OpenAI Responses"), ""]
    by_source = collections.Counter(c.source for c in cases if c.ratio == RATIOS[0])
    out.append(
        f"{n_traj} recorded tool-call runs ({', '.join(f'{s}: {n}' for s, n in by_source.items())})"
        + (f", the first {limit} (`--limit {limit}`)" if limit else "") +
        ", each written in each door's wire format (`bench/doors.py`: `to_anthropic`, `to_responses`), read "
        "into the neutral model by the door's own code (`messages_model.conversation_of`, "
        "`responses_model.to_messages`), compressed by `bench/recoverability.py`'s `ctxgate` method (the "
        "chain as the proxy runs it, **with the scripted stand-in summary, not an LLM**) to 50% / 25% of that "
        "door's own neutral size, rendered back by the door (`render`, `to_request`) and scored in the door's "
        "terms (see `bench/recoverability.py`'s docstring, `--doors`: *valid* is the API's rules for that door plus "
        "the client's system prompt / instructions kept; *latest 3* is the last 3 messages / turns / items; "
        "*tokens / budget* counts the rendered request read back through the door). Means over the cases where "
        "a score applies; *mean of scores* averages each case's applicable scores. As in `recoverability.py`, "
        "the budget is the compaction *target* (half the effective budget), so *within budget* understates "
        f"what reaches a provider. Cases: the ones that can fit on the chat door (system + task under the "
        f"budget), the same cases for every door. Run time {seconds:.0f}s.\n")
    for ratio in RATIOS:
        feas = [c for c in cases if c.ratio == ratio and c.feasible]
        out.append(f"### Budget {ratio:.0%} of the request's size — {len(feas)} cases that can fit\n")
        out.append(door_table(feas) + "\n")
        out.append("Paired against the chat door, same cases:\n")
        out.append(paired_table(feas) + "\n")
        levels = {d: collections.Counter(c.levels[d] for c in feas) for d in DOORS}
        out.append("Levels the chain ran: " + "; ".join(
            f"{d}: " + ", ".join(f"{lv or 'none'} {n}" for lv, n in levels[d].most_common(4)) for d in DOORS)
                   + ".\n")
        bad = [(c.name, d, p) for c in feas for d in DOORS[1:] for p in c.problems.get(d, [])[:1]]
        if bad:
            out.append(f"API rule breaks ({len(bad)}; first 5): " + "; ".join(
                f"{n} via {d}: {p}" for n, d, p in bad[:5]) + ".\n")
    feas = [c for c in cases if c.feasible]
    worse_files = sorted({c.name for c in feas if _below(c, "messages", "files")})
    worse_latest = sorted({c.name for c in feas if _below(c, "messages", "latest")})
    out.append("### Where a door scores below chat, and why\n")
    out.append(
        "The Responses door scores as the chat door does: `to_messages` gives the pipeline chat-completions "
        "messages (the items ride along under `item` / `items`, which the counter skips), so the chain sees the "
        "same conversation and `to_request` writes back the items it left alone byte for byte.\n\n"
        "The Messages door hands the pipeline Anthropic-shaped messages (content blocks):\n\n"
        f"- *files* ({len(worse_files)} cases below chat: {', '.join(worse_files) or 'none'}). The summariser's "
        "transcript (`pipeline/autocompact.py: serialise`) and activeRestore's file headers "
        "(`pipeline/restore.py`) read a message through `protocols/base.readable_text`, which takes the output of "
        "each `tool_result` block and each `tool_use` call as well as the text (before that, both saw only the "
        "text parts, and three SWE-agent runs lost `/testbed/reproduce.py`).\n"
        f"- *latest 3* ({len(worse_latest)} cases below chat: {', '.join(worse_latest) or 'none'}). In these "
        "runs the last three messages are the same in both forms (a tool result, the agent's answer, the "
        "user's next message), and the Messages door cuts the tool result in the third-last turn where chat "
        "keeps it whole. Not pinned down yet: the likely cause is the recent window's reach (10 messages; "
        "`to_anthropic` merges earlier same-role messages, so the Messages form's window spans more steps, "
        "more of it is over the target, and the last-resort `RecentWindowCut` reaches the third-last turn). "
        "A `tool_result` block counts as its output (over these runs the tool results count "
        f"{inflation - 1:.0%} more than as chat `tool` messages). Both doors keep the last two turns "
        "unchanged.\n\n"
        "None of this breaks the API's rules: every rendered Messages request alternates, starts with the "
        "user, and has its `tool_use` / `tool_result` blocks paired; every Responses request has each output "
        "after its call.\n")
    if errors:
        out.append(f"Failures ({len(errors)}): " + "; ".join(errors[:5]) + "\n")
    common.publish("recoverability-doors", "\n".join(out), out_file)


def run_doors(args: argparse.Namespace, counter: TokenCounter, methods: dict[str, Any]) -> None:
    """The recoverability-doors section: every tool-call run through each door."""
    runs = [(n, t, m) for n, t, m in common.named_trajectories(every=True) if dialect_of(t) == TOOL_CALLS]
    runs = runs[: args.limit]
    diagnostics: dict[str, Any] = methods.pop("_diagnostics")
    compress = methods["ctxgate"]

    def levels() -> str:
        r = diagnostics.pop("last", None)
        return ",".join(dict.fromkeys(s.level.value for s in r.steps)) if r is not None else ""

    cases: list[DoorCase] = []
    errors: list[str] = []
    started = time.perf_counter()
    common.progress(f"recoverability per door: {len(runs)} tool-call runs × {len(RATIOS)} budgets "
                    f"× {len(DOORS)} doors")
    for k, (name, traj, messages) in enumerate(runs):
        needs = needs_of(messages, text_mode=False)
        size = counter.count_messages(messages)
        floor = floor_of(messages, counter.count_messages)
        for ratio in RATIOS:
            budget = int(size * ratio)
            case = DoorCase(name, traj.source, ratio, floor <= budget)
            try:
                out = compress(traj.source, messages, budget)
                case.levels["chat"] = levels()
                case.scores["chat"], case.sizes["chat"] = score(needs, out, budget, counter), size
                for door, through in (("messages", through_messages), ("responses", through_responses)):
                    door_size, door_budget, r = through(messages, compress, traj.source, ratio, counter)
                    case.levels[door] = levels()
                    case.scores[door] = door_score(needs, r, door_budget, counter)
                    case.sizes[door], case.problems[door] = door_size, r.problems
            except Exception as e:  # noqa: BLE001  a failing door is reported, the run goes on
                errors.append(f"{name} @ {ratio:.0%}: {type(e).__name__}: {str(e)[:200]}")
                continue
            cases.append(case)
        if (k + 1) % 25 == 0 or k + 1 == len(runs):
            common.progress(f"  {k + 1}/{len(runs)} runs ({time.perf_counter() - started:.1f}s)")
    write_doors(cases, len(runs), args.limit, time.perf_counter() - started, errors,
                tool_result_inflation(runs, counter), args.out)

if __name__ == "__main__":
    main()
