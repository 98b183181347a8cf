"""Prefix stability of the forwarded requests over long replays, and what speculative
Autocompact saves at the compaction points.

One 200,000-token session (the recorded runs back to back, common.build_conversation) and
every recorded run of 10 agent turns or more, replayed turn by turn through `ctxgate replay`'s
driver (proxy/replay/driver.py: `Compactor.prepare` as the gateway runs it, session locked,
state saved, loop guard reset after each reply, speculative Autocompact on) at budgets of 50%
and 25% of their final size (o200k_base, tools schema included; the provider's count is
ctxgate's). A pair of consecutive requests is *stable* when the second starts with the first
byte for byte. A *compaction point* is a turn where the session's compaction records changed:
the forwarded prefix changes there by design; a break anywhere else would be a bug. The summary
is a fixed text returned at once. A run is replayed at a budget only when its system prompt,
task and tools schema fit the compaction target (50% of the effective budget): otherwise every
turn is a compaction point (most tau-bench runs: a 1,270-token policy prompt). Then the same
replays at 50% with a summary that takes 300 ms and an upstream that takes 500 ms (slept only
while a background compaction runs): time in `Compactor.prepare` per turn, speculation off
(a compaction point waits for the summary) and on (made during an earlier turn's upstream time).

    .venv/bin/python bench/prefix_stability.py             # writes its section of RESULTS.md
    .venv/bin/python bench/prefix_stability.py --session-tokens 20000 --runs 2 --out /tmp/x.md
"""
from __future__ import annotations

import asyncio
import statistics
import sys
from typing import Any

import common

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.turns import leading_instructions, task_index
from ctxgate.proxy.replay.driver import Message, Replay, agent_turns, replay as replay_session

RATIOS = (0.50, 0.25)
MIN_TURNS = 10
LONG_SESSION_TOKENS = 200_000
SUMMARY_S = 0.3
UPSTREAM_S = 0.5
SUMMARY = """1. User goal: fix the failing behaviour described in the task.
2. Completed steps: explored the repository; reproduced the problem.
3. Key decisions: edited the module that raised the error.
4. Open issues: run the test suite again.
5. Current files: see the restored file list.
6. Skill/tool context: str_replace_editor, execute_bash."""


async def replay(messages: list[Message], tools: list[dict[str, Any]] | None, budget: int, *,
                 speculate: bool = True, summary_s: float = 0.0, upstream_s: float = 0.0) -> Replay:
    """`ctxgate replay`'s driver with the gpt-4o tokenizer and a scripted summary that takes `summary_s`."""
    async def summarize(_: list[Message]) -> str:
        if summary_s:
            await asyncio.sleep(summary_s)
        return SUMMARY

    return await replay_session(messages, tools, budget, counter=common.gpt4o_counter(), summarize=summarize,
                                speculate=speculate, upstream_s=upstream_s)


Run = tuple[str, list[Message], list[dict[str, Any]] | None]
"""(name, request-ready messages, tools schema)."""


def _long_runs() -> list[Run]:
    runs = [(name, msgs, t.tools) for name, t, msgs in common.named_trajectories()
            if len(agent_turns(msgs)) >= MIN_TURNS]
    return sorted(runs, key=lambda r: -len(agent_turns(r[1])))


def _feasible(msgs: list[Message], tools: list[dict[str, Any]] | None, budget: int) -> bool:
    """The system prompt, task and tools schema fit the compaction target: otherwise no
    compaction can bring the session under it, and every turn is a compaction point."""
    config, counter = PipelineConfig(), common.gpt4o_counter()
    task = task_index(msgs)
    pinned = msgs[:leading_instructions(msgs)] + ([msgs[task]] if task is not None else [])
    return counter.count_request(pinned, tools) <= config.target_ratio * config.effective_budget(budget)


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "—"


def results(out: str | None, session_tokens: int, most: int | None) -> int:
    counter = common.gpt4o_counter()
    long_session = common.build_conversation(session_tokens, counter)
    runs = _long_runs()[:most]
    groups: list[tuple[str, list[Run]]] = [(f"one {session_tokens // 1000}K-token session",
                                            [("long session", long_session, None)]),
                                           (f"{len(runs)} recorded runs", runs)]
    common.progress(f"prefix stability: a {len(agent_turns(long_session))}-turn session and {len(runs)} runs with "
                    f"≥ {MIN_TURNS} agent turns × {len(RATIOS)} budgets")
    rows = []
    for label, group in groups:
        for ratio in RATIOS:
            pairs = stable = points = unexplained = summaries = over = replayed = 0
            for name, msgs, tools in group:
                budget = int(counter.count_request(msgs, tools) * ratio)
                if not _feasible(msgs, tools, budget):
                    continue
                replayed += 1
                run = asyncio.run(replay(msgs, tools, budget))
                pairs += len(run.forwarded) - 1
                stable += len(run.forwarded) - 1 - len(run.breaks)
                points += run.points
                unexplained += sum(not b.compacted for _, b in run.breaks)
                summaries += run.summaries
                over += sum(f.tokens > budget for f in run.forwarded)
            pairs = max(1, pairs)
            rows.append([label, f"{ratio:.0%}", f"{replayed} of {len(group)}", pairs, f"{stable / pairs:.1%}", points,
                         f"{(pairs - unexplained) / pairs:.1%}", unexplained, summaries, over])
            common.progress(f"  {label} at {ratio:.0%}: {stable}/{pairs} stable, {points} compaction points")
    runs = [r for r in groups[0][1] + runs
            if _feasible(r[1], r[2], int(counter.count_request(r[1], r[2]) * RATIOS[0]))]

    common.progress(f"speculation: compaction turns with a {SUMMARY_S * 1000:.0f} ms summary, on and off")
    latency: dict[bool, list[float]] = {True: [], False: []}
    others: dict[bool, list[float]] = {True: [], False: []}
    adopted = 0
    for name, msgs, tools in runs:
        budget = int(counter.count_request(msgs, tools) * RATIOS[0])
        for speculate in (False, True):
            run = asyncio.run(replay(msgs, tools, budget, speculate=speculate, summary_s=SUMMARY_S,
                                     upstream_s=UPSTREAM_S))
            latency[speculate] += [f.prepare_ms for f in run.forwarded if f.compacted]
            others[speculate] += [f.prepare_ms for f in run.forwarded if not f.compacted]
            adopted += sum(f.speculative for f in run.forwarded) if speculate else 0

    lines = [common.section_header("Prefix stability over long replays, and speculative Autocompact"), ""]
    lines.append(common.about(__doc__) + f"\n\nThe long session: {len(agent_turns(long_session))} agent turns.\n")
    lines.append(common.table(["replay", "budget", "replayed", "request pairs", "stable (strict)", "compaction points",
                               "stable outside compaction points", "breaks elsewhere", "summaries",
                               "requests over budget"], rows))
    lines.append("")
    lines.append(f"Speculative Autocompact, the same replays at 50% ({len(runs)}), median ms in `Compactor.prepare`:\n")
    lines.append(common.table(
        ["speculation", "compaction turns", "median ms at compaction turns", "p90 ms", "other turns, median ms"],
        [["off", len(latency[False]), _ms(latency[False]), f"{common.pct(latency[False], 0.9):.1f}",
          _ms(others[False])],
         ["on", len(latency[True]), _ms(latency[True]), f"{common.pct(latency[True], 0.9):.1f}", _ms(others[True])]]))
    lines.append(f"\nWith speculation on, {adopted} of {len(latency[True])} compaction points applied a compaction "
                 "prepared in the background; the others ran the chain at the trigger (a speculation that no "
                 "longer left room, or a session where one was already wasted).")
    common.publish("stability", "\n".join(lines), out)
    return 0


def main() -> int:
    p = common.parser(__doc__, wait=600.0)
    p.add_argument("--session-tokens", type=int, default=LONG_SESSION_TOKENS, help="the long session's size")
    p.add_argument("--runs", type=int, default=None, help="only the N longest recorded runs (a quick run)")
    args = p.parse_args()
    common.wait_for_quiet(max_wait_s=args.max_wait)
    return results(args.out, args.session_tokens, args.runs)


if __name__ == "__main__":
    sys.exit(main())
