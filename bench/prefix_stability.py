"""Prefix stability of the forwarded requests over long replays, and what speculative
Autocompact saves at the compaction points.

One long session (200K tokens of the recorded runs back to back, bench/common.py:
build_conversation) and every recorded run with at least 10 agent turns are replayed turn
by turn through the compactor as the proxy runs it (proxy/replay/driver.py, `ctxgate replay`'s driver) at budgets of
50% and 25% of their final size. For each pair of consecutive forwarded requests a, b: *stable* when b starts
with a byte for byte (the provider's prompt cache keeps hitting); a break at a
compaction point (the session's records changed that turn) is the one break a
compaction causes; a break anywhere else would be a bug. Then the compaction turns'
latency with a summary that takes 300 ms, speculation on and off.

    .venv/bin/python bench/prefix_stability.py             # writes its section of RESULTS.md
    .venv/bin/python bench/prefix_stability.py --contract  # the contract's run, each break's cause

`--contract` replays the SWE-Gym OpenHands sample at 35% as ../shared/contract/
check_pipeline.py does (its upstream counts the messages only, no tools schema).
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import common

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.microcompact import MicrocompactStrategy
from ctxgate.pipeline.notes import is_compaction_note, is_restore_block
from ctxgate.pipeline.turns import leading_instructions, task_index
from ctxgate.pipeline.request import CompressionRequest
from ctxgate.proxy.replay.driver import Message, Replay, agent_turns, replay as replay_session

TRAJECTORY = common.ROOT.parent / "shared" / "trajectories" / "swe-gym-openhands" / "sample_raw.json"
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
                 provider_count: Any = None, speculate: bool = True, summary_s: float = 0.0,
                 upstream_s: float = 0.0) -> Replay:
    """`ctxgate replay`'s driver with the gpt-4o tokenizer and a scripted summary that takes `summary_s`."""
    async def summarize(_: list[Message]) -> str:
        if summary_s:
            await asyncio.sleep(summary_s)
        return SUMMARY

    return await replay_session(messages, tools, budget, counter=common.gpt4o_counter(), summarize=summarize,
                                provider_count=provider_count, speculate=speculate, upstream_s=upstream_s)


def contract_tokens(messages: list[Message]) -> int:
    """The contract client's own count (4 per message + content + tool call text)."""
    enc = common.gpt4o_counter()
    total = 3
    for m in messages:
        text = m.get("content") or ""
        for tc in m.get("tool_calls") or []:
            text += " " + tc["function"]["name"] + " " + tc["function"]["arguments"]
        total += 4 + enc.count(text)
    return total


def load_contract_run(path: Path) -> tuple[list[Message], list[dict[str, Any]] | None]:
    record = json.loads(path.read_text())[0]
    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    msgs = [{k: v for k, v in m.items() if v is not None and k in keep} for m in record["messages"]]
    for m in msgs:
        for tc in m.get("tool_calls") or []:
            tc.pop("index", None)
    return msgs, record.get("tools")


def fewest_breaks(msgs: list[Message], budget: int) -> list[int]:
    """A lower bound on the contract run's compaction points: the turns where a compaction
    is unavoidable even if every tool output were cut as it arrived (Microcompact's
    thresholds) and every compaction left nothing but the instructions, the task and the turn
    in progress (no summary, no restore blocks), in the contract upstream's count."""
    config, counter = PipelineConfig(), common.gpt4o_counter()
    effective = config.effective_budget(budget)
    request = CompressionRequest(msgs, effective, counter)
    cut, _ = MicrocompactStrategy(config.microcompact, config.pin_first_user, effective).compact_range(
        request, 0, len(msgs))
    sizes = [counter.count_structured(m) for m in cut]
    room = config.trigger_ratio * effective - contract_tokens(msgs[:2])
    points, start, previous = [], 2, 2
    for i in agent_turns(msgs):
        if sum(sizes[start:i]) > room:
            points.append(i)
            start = previous  # the turn in progress: the previous reply and what followed it
        previous = i
    return points


def describe_break(a: list[Message], b: list[Message]) -> str:
    k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if k >= len(b):
        return f"b is shorter ({len(b)} < {len(a)})"

    def kind(m: Message) -> str:
        if is_restore_block(m):
            return "restore block"
        return "compaction note: " + m["content"][:40] if is_compaction_note(m) else m.get("role", "?")

    x, y = a[k], b[k]
    if x.get("role") == y.get("role") and x.get("tool_call_id") == y.get("tool_call_id") and x.get("role") != "system":
        return (f"message {k} ({kind(x)}) changed in place: "
                f"{len(str(x.get('content')))} -> {len(str(y.get('content')))} chars")
    return f"message {k}: {kind(x)} -> {kind(y)}"


def contract(ratio: float, speculate: bool, verbose: bool) -> int:
    msgs, tools = load_contract_run(TRAJECTORY)
    budget = int(contract_tokens(msgs) * ratio)
    run = asyncio.run(replay(msgs, tools, budget, provider_count=contract_tokens, speculate=speculate))
    for a, b in run.breaks:
        cause = "compaction point" if b.compacted else "NOT a compaction point"
        print(f"turn {b.turn:3d}: {cause:22s} levels={','.join(b.levels) or '-':28s} "
              f"{describe_break(a.messages, b.messages)}")
    if verbose:
        for f in run.forwarded:
            print(f"turn {f.turn:3d}: {len(f.messages):3d} messages {f.tokens:5d} tokens {','.join(f.levels)}")
    bound = fewest_breaks(msgs, budget)
    pairs = max(1, len(run.forwarded) - 1)
    print(f"unavoidable compaction points (lower bound): {len(bound)} at turns {bound}, "
          f"so at best {1 - len(bound) / pairs:.0%} stable")
    print(f"budget {budget}, forwarded {len(run.forwarded)}, breaks {len(run.breaks)} "
          f"({sum(not b.compacted for _, b in run.breaks)} not at a compaction point), "
          f"prefix stable {1 - len(run.breaks) / pairs:.0%}, summaries {run.summaries}, "
          f"over budget {sum(f.tokens > budget * 1.03 for f in run.forwarded)}, "
          f"max forwarded {max(f.tokens for f in run.forwarded)}")
    return 0


def _long_runs() -> list[tuple[str, list[Message], list[dict[str, Any]] | None]]:
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


def results(out: str | None) -> int:
    counter = common.gpt4o_counter()
    long_session = common.build_conversation(LONG_SESSION_TOKENS, counter)
    runs = _long_runs()
    groups = [(f"one {LONG_SESSION_TOKENS // 1000}K-token session", [("long session", long_session, None)]),
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
    adopted, others = 0, {True: [], False: []}
    for name, msgs, tools in runs:
        budget = int(counter.count_request(msgs, tools) * RATIOS[0])
        for speculate in (False, True):
            run = asyncio.run(replay(msgs, tools, budget, speculate=speculate, summary_s=SUMMARY_S,
                                     upstream_s=UPSTREAM_S))
            latency[speculate] += [f.prepare_ms for f in run.forwarded if f.compacted]
            others[speculate] += [f.prepare_ms for f in run.forwarded if not f.compacted]
            adopted += sum(f.speculative for f in run.forwarded) if speculate else 0

    lines = [common.section_header("Prefix stability over long replays, and speculative Autocompact"), ""]
    lines.append(
        f"One {LONG_SESSION_TOKENS:,}-token session of {len(agent_turns(long_session))} agent turns (the recorded runs "
        "back to back, bench/common.py: build_conversation) and every recorded run with "
        f"≥ {MIN_TURNS} agent turns ({len(runs) - 1}: SWE-agent, OpenHands and tau-bench), replayed "
        "turn by turn through `Compactor.prepare` as the gateway runs it (proxy/replay/driver.py: session locked, "
        "state saved, loop guard reset after each reply, speculative Autocompact on), each at budgets of 50% and 25% "
        "of its final size (o200k_base, tools schema included; the provider's count is ctxgate's). A pair of "
        "consecutive requests is *stable* when the second starts with the first byte for byte. A *compaction point* "
        "is a turn where the session's compaction records changed: the forwarded prefix changes there by design. "
        "*Stable outside compaction points* is the issue's measure (byte-identical up to the last compaction point); "
        "a break elsewhere would be a bug. The summary is a fixed text returned at once. A run is replayed at a "
        "budget only when its system prompt, task and tools schema fit the compaction target (50% of the effective "
        "budget); otherwise no compaction can bring it under the target and every turn is one (most tau-bench runs: "
        "a 1,270-token policy prompt).\n")
    lines.append(common.table(["replay", "budget", "replayed", "request pairs", "stable (strict)", "compaction points",
                               "stable outside compaction points", "breaks elsewhere", "summaries",
                               "requests over budget"], rows))
    lines.append("")
    lines.append(
        f"Speculative Autocompact, the same replays at 50% ({len(runs)}): "
        f"the summary now takes {SUMMARY_S * 1000:.0f} ms, and the "
        f"upstream {UPSTREAM_S * 1000:.0f} ms per reply (slept only while a background compaction runs). Time in "
        "`Compactor.prepare` per turn, median ms; a compaction point with speculation off waits for the summary, "
        "with it on the summary was made during an earlier turn's upstream time.\n")
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
    parser = common.parser(__doc__, wait=600.0)
    parser.add_argument("--contract", action="store_true", help="the contract's run, with the cause of every break")
    parser.add_argument("--ratio", type=float, default=0.35, help="with --contract: the budget's share")
    parser.add_argument("--no-speculator", action="store_true", help="with --contract: speculation off")
    parser.add_argument("--verbose", action="store_true", help="with --contract: every forwarded request")
    args = parser.parse_args()
    if args.contract:
        return contract(args.ratio, not args.no_speculator, args.verbose)
    common.wait_for_quiet(max_wait_s=args.max_wait)
    return results(args.out)


if __name__ == "__main__":
    sys.exit(main())
