"""A recorded run replayed turn by turn through the compactor, as proxy/chat.py runs it
(no servers): the session locked, `Compactor.prepare`, the state saved; after each turn
the loop guard reset (the upstream answered) and the count offset measured against the
provider's count of what was forwarded. Used by bench/prefix_stability.py.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import common  # noqa: F401  (sets up the tokenizer files and the import path)

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.proxy.engine.compaction import Compactor, fingerprints_of
from ctxgate.proxy.engine.turn_budget import Turn, measured_calibration
from ctxgate.proxy.engine.speculative import Speculator
from ctxgate.proxy.engine.state import MemorySessionStore, SessionState
from common import in_memory_sessions

Message = dict[str, Any]
SUMMARY = """1. User goal: fix the failing behaviour described in the task.
2. Completed steps: explored the repository; reproduced the problem.
3. Key decisions: edited the module that raised the error.
4. Open issues: run the test suite again.
5. Current files: see the restored file list.
6. Skill/tool context: str_replace_editor, execute_bash."""


@dataclass
class Forwarded:
    turn: int
    """Index of the assistant message this request was sent for."""
    messages: list[Message]
    levels: list[str]
    compacted: bool
    """A compaction point: the session's records changed this turn."""
    tokens: int
    """In the provider's count."""
    prepare_ms: float
    speculative: bool
    """The compaction applied was prepared in the background."""


@dataclass
class Replay:
    forwarded: list[Forwarded] = field(default_factory=list)
    summaries: int = 0

    @property
    def breaks(self) -> list[tuple[Forwarded, Forwarded]]:
        """Consecutive requests a, b where b does not start with a."""
        return [(a, b) for a, b in zip(self.forwarded, self.forwarded[1:])
                if b.messages[:len(a.messages)] != a.messages]

    @property
    def points(self) -> int:
        return sum(f.compacted for f in self.forwarded)


def agent_turns(messages: list[Message]) -> list[int]:
    """The indices i where the agent replied: each request is messages[:i]."""
    return [i for i, m in enumerate(messages) if i >= 2 and m.get("role") == "assistant"]


async def replay(messages: list[Message], tools: list[dict[str, Any]] | None, budget: int, *,
                 provider_count: Callable[[list[Message]], int] | None = None, speculate: bool = True,
                 summary_s: float = 0.0, upstream_s: float = 0.0) -> Replay:
    """`provider_count`: what the provider reports as `usage.prompt_tokens` (default:
    ctxgate's own count, tools included: an OpenAI-like provider). `summary_s`: how long a
    summary takes. `upstream_s`: the upstream's reply time, slept only while a background
    compaction runs (nothing else happens in it), so the replay stays fast."""
    counter = common.gpt4o_counter()
    sessions = MemorySessionStore()
    speculator = Speculator(in_memory_sessions(sessions)) if speculate else None
    compactor = Compactor(speculator=speculator)
    out = Replay()

    async def summarize(_: list[Message]) -> str:
        out.summaries += 1
        if summary_s:
            await asyncio.sleep(summary_s)
        return SUMMARY

    for i in agent_turns(messages):
        request = messages[:i]
        turn = Turn(messages=request, fingerprints=fingerprints_of(request), tools=tools, counter=counter,
                    config=PipelineConfig(), max_input_tokens=budget, summarize=summarize)
        started = time.perf_counter()
        async with sessions.lock("bench", "replay"):
            state = await sessions.load("bench", "replay") or SessionState("bench", "replay")
            turn.count_offset, turn.count_scale = state.count_offset, state.count_scale
            records_before = [r.prefix_len for r in state.records]
            plan = await compactor.prepare(state, turn)
            compacted = [r.prefix_len for r in state.records] != records_before
            state.has_attempted_reactive_compact = False
            sent = provider_count(plan.messages) if provider_count else plan.tokens_out
            calibration = measured_calibration(turn, plan.tokens_out, sent)
            if calibration is not None:
                state.count_offset, state.count_scale = calibration
            await sessions.save(state)
        elapsed = (time.perf_counter() - started) * 1000
        speculative = any(h.startswith("speculative") for h in plan.hints)
        out.forwarded.append(Forwarded(i, plan.messages, plan.levels, compacted, sent, elapsed, speculative))
        running = speculator is not None and speculator.running("bench", "replay")
        await asyncio.sleep(upstream_s if running and upstream_s else 0.005)  # a background compaction gets to run
    if speculator is not None:
        await speculator.close()
    return out
