"""Prefix stability of the forwarded requests, in process, with the cause of every break.

The contract check (../shared/contract/check_pipeline.py) replays the SWE-Gym OpenHands
sample through a running ctxgate at 35% of its size and counts the consecutive forwarded
requests a, b where b does not start with a. This does the same through `Compactor`
directly (no servers, a fixed summary), so a change can be measured in seconds, and says
for each break which message first differs and what it is: a compaction point (a chain
run that turn) is the one break allowed; anything else is a bug.

    .venv/bin/python bench/prefix_stability.py [--ratio 0.35] [--no-speculator] [--verbose]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common  # noqa: F401  (sets up the tokenizer files and the import path)

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.microcompact import MicrocompactStrategy
from ctxgate.pipeline.notes import is_compaction_note, is_restore_block
from ctxgate.proxy.compaction import Compactor, Turn, fingerprints_of, measured_offset
from ctxgate.proxy.speculative import Speculator
from ctxgate.proxy.state import MemorySessionStore, SessionState

TRAJECTORY = common.ROOT.parent / "shared" / "trajectories" / "swe-gym-openhands" / "sample_raw.json"
SUMMARY = """1. User goal: fix the failing behaviour described in the task.
2. Completed steps: explored the repository; reproduced the problem.
3. Key decisions: edited the module that raised the error.
4. Open issues: run the test suite again.
5. Current files: see the restored file list.
6. Skill/tool context: str_replace_editor, execute_bash."""
Message = dict[str, Any]


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


def load(path: Path) -> tuple[list[Message], list[dict[str, Any]] | None]:
    record = json.loads(path.read_text())[0]
    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    msgs = [{k: v for k, v in m.items() if v is not None and k in keep} for m in record["messages"]]
    for m in msgs:
        for tc in m.get("tool_calls") or []:
            tc.pop("index", None)
    return msgs, record.get("tools")


def kind(message: Message) -> str:
    if is_restore_block(message):
        return "restore block"
    if is_compaction_note(message):
        return "compaction note: " + message["content"][:40]
    return message.get("role", "?")


@dataclass
class Forwarded:
    turn: int
    messages: list[Message]
    levels: list[str]
    compacted: bool
    tokens: int


async def replay(ratio: float, speculate: bool = True) -> tuple[list[Forwarded], int, int]:
    """The turns as proxy/chat.py runs them: session locked, prepared, saved; after each, the
    loop guard reset (the scripted upstream always answers) and the count offset measured
    against the contract upstream's `usage.prompt_tokens` (messages only, no tools schema)."""
    msgs, tools = load(TRAJECTORY)
    budget = int(contract_tokens(msgs) * ratio)
    counter = common.gpt4o_counter()
    sessions = MemorySessionStore()
    speculator = Speculator(sessions) if speculate else None
    compactor = Compactor(speculator=speculator)
    summaries = 0

    async def summarize(_: list[Message]) -> str:
        nonlocal summaries
        summaries += 1
        return SUMMARY

    out: list[Forwarded] = []
    for i in range(2, len(msgs)):
        if msgs[i]["role"] != "assistant":
            continue
        turn_messages = msgs[:i]
        turn = Turn(messages=turn_messages, fingerprints=fingerprints_of(turn_messages), tools=tools,
                    counter=counter, config=PipelineConfig(), max_input_tokens=budget, summarize=summarize)
        async with sessions.lock("bench", "prefix"):
            state = await sessions.load("bench", "prefix") or SessionState("bench", "prefix")
            turn.count_offset = state.count_offset
            records_before = [r.prefix_len for r in state.records]
            plan = await compactor.prepare(state, turn)
            compacted = [r.prefix_len for r in state.records] != records_before
            state.has_attempted_reactive_compact = False
            offset = measured_offset(turn, plan.tokens_out, contract_tokens(plan.messages))
            if offset is not None:
                state.count_offset = offset
            await sessions.save(state)
        await asyncio.sleep(0.01)  # the upstream's reply: a background compaction gets to run
        out.append(Forwarded(i, plan.messages, plan.levels, compacted, contract_tokens(plan.messages)))
    if speculator is not None:
        await speculator.close()
    return out, budget, summaries


def fewest_breaks(ratio: float) -> list[int]:
    """A lower bound on the compaction points, for comparison: the turns where a compaction
    is unavoidable even if every tool output were cut as it arrived (Microcompact's
    thresholds) and every compaction left nothing but the instructions, the task and the turn
    in progress (no summary, no restore blocks), in the contract upstream's count (which
    leaves the tools schema out; ctxgate measures that difference on the first reply)."""
    msgs, _ = load(TRAJECTORY)
    config, counter = PipelineConfig(), common.gpt4o_counter()
    budget = config.effective_budget(int(contract_tokens(msgs) * ratio))
    cut, _ = MicrocompactStrategy(config.microcompact, config.pin_first_user, budget).compact_from(msgs, 0, counter)
    sizes = [counter.count_structured(m) for m in cut]
    room = config.trigger_ratio * budget - contract_tokens(msgs[:2])
    points, start, previous = [], 2, 2
    for i in range(2, len(msgs)):
        if msgs[i]["role"] != "assistant":
            continue
        if sum(sizes[start:i]) > room:
            points.append(i)
            start = previous  # the turn in progress: the previous reply and what followed it
        previous = i
    return points


def first_difference(a: list[Message], b: list[Message]) -> int:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return min(len(a), len(b))


def describe(a: list[Message], b: list[Message], k: int) -> str:
    if k >= len(b):
        return f"b is shorter ({len(b)} < {len(a)})"
    x, y = a[k], b[k]
    if x.get("role") == y.get("role") and x.get("tool_call_id") == y.get("tool_call_id") and x.get("role") != "system":
        return (f"message {k} ({kind(x)}) changed in place: {len(str(x.get('content')))} -> "
                f"{len(str(y.get('content')))} chars")
    return f"message {k}: {kind(x)} -> {kind(y)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.35)
    parser.add_argument("--no-speculator", action="store_true", help="without speculative Autocompact")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    forwarded, budget, summaries = asyncio.run(replay(args.ratio, not args.no_speculator))
    breaks, unexplained = 0, 0
    for a, b in zip(forwarded, forwarded[1:]):
        if b.messages[:len(a.messages)] == a.messages:
            continue
        breaks += 1
        unexplained += not b.compacted
        k = first_difference(a.messages, b.messages)
        cause = "compaction point" if b.compacted else "NOT a compaction point"
        print(f"turn {b.turn:3d}: {cause:22s} levels={','.join(b.levels) or '-':28s} {describe(a.messages, b.messages, k)}")
    over = sum(f.tokens > budget * 1.03 for f in forwarded)
    share = 1 - breaks / max(1, len(forwarded) - 1)
    if args.verbose:
        for f in forwarded:
            print(f"turn {f.turn:3d}: {len(f.messages):3d} messages {f.tokens:5d} tokens {','.join(f.levels)}")
    bound = fewest_breaks(args.ratio)
    print(f"unavoidable compaction points (lower bound): {len(bound)} at turns {bound}, "
          f"so at best {1 - len(bound) / max(1, len(forwarded) - 1):.0%} stable")
    print(f"budget {budget}, forwarded {len(forwarded)}, breaks {breaks} ({unexplained} not at a compaction point), "
          f"prefix stable {share:.0%}, summaries {summaries}, over budget {over}, "
          f"max forwarded {max(f.tokens for f in forwarded)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
