"""A recorded session replayed turn by turn through the compactor, as the turn engine runs
it, with no servers and no network.

Each agent turn i (messages[i] is an assistant message, i >= 2) is the request
messages[:i], as the agent sent it. For each: the session locked, `Compactor.prepare`
(stored records, the chain over the trigger, the loop guard, speculative Autocompact),
the state saved. Then the upstream "answers" with the recorded reply: the loop guard is
reset and the count offset measured against the provider's count of what was forwarded.
A `context_exhausted` refusal is kept as a refused turn; the agent's next turn goes on, as
a real agent would after the error.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.notes import with_notice
from ctxgate.pipeline.policy import Prices
from ctxgate.pipeline.tokens import TokenCounter
from ctxgate.wal.config import WalConfig
from ..engine.compaction import Compactor, fingerprints_of
from ..engine.content_store import MemoryContentStore
from ..engine.depth import prices_of
from ..engine.journal import Journal
from ..engine.session import Sessions
from ..engine.speculative import Speculator
from ..engine.state import CompactionRecord, MemorySessionStore, SessionState
from ..engine.turn_budget import Summarize, Turn, measured_calibration
from ..errors import GatewayError

Message = dict[str, Any]
TENANT, SESSION = "replay", "replay"


@dataclass
class Forwarded:
    """One agent turn: the request ctxgate forwarded for it, or its refusal."""
    turn: int
    """Index of the assistant message this request was sent for: the request is messages[:turn]."""
    messages: list[Message]
    """What was forwarded; empty when the turn was refused."""
    levels: list[str]
    compacted: bool
    """A compaction point: the session's records changed this turn."""
    tokens: int
    """The forwarded request in the provider's count (0 when refused)."""
    prepare_ms: float
    speculative: bool
    """The compaction applied was prepared in the background."""
    tokens_in: int = 0
    """ctxgate's count of what the agent sent: its whole history and the tools schema."""
    refused: str = ""
    """The CONTEXT_EXHAUSTED message of a refused turn."""
    record: CompactionRecord | None = None
    """The record this turn's compaction made (`compacted` turns)."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """The compaction log entries of this turn: level, span, tokens before and after."""
    hints: list[str] = field(default_factory=list)


@dataclass
class Replay:
    turns: list[Forwarded] = field(default_factory=list)
    summaries: int = 0

    @property
    def forwarded(self) -> list[Forwarded]:
        """The turns that reached the upstream."""
        return [f for f in self.turns if not f.refused]

    @property
    def breaks(self) -> list[tuple[Forwarded, Forwarded]]:
        """Consecutive forwarded requests a, b where b does not start with a."""
        sent = self.forwarded
        return [(a, b) for a, b in zip(sent, sent[1:]) if b.messages[:len(a.messages)] != a.messages]

    @property
    def points(self) -> int:
        return sum(f.compacted for f in self.turns)


def agent_turns(messages: list[Message]) -> list[int]:
    """The indices i where the agent replied: each request is messages[:i]."""
    return [i for i, m in enumerate(messages) if i >= 2 and m.get("role") == "assistant"]


def in_memory_sessions(store: MemorySessionStore) -> Sessions:
    """The session transaction over `store`, with a WAL that is never written (a replay
    keeps its state in memory): what the speculator needs to keep a background result."""
    return Sessions(store, Journal(tempfile.mkdtemp(prefix="ctxgate-replay-"), WalConfig(enabled=False)))


async def replay(messages: list[Message], tools: list[dict[str, Any]] | None, budget: int, *,
                 counter: TokenCounter, summarize: Summarize, config: PipelineConfig | None = None,
                 provider_count: Callable[[list[Message]], int] | None = None, speculate: bool = True,
                 upstream_s: float = 0.0, wait_background: bool = False, prices: Prices | None = None,
                 on_turn: Callable[[Forwarded], None] | None = None) -> Replay:
    """`budget`: the model's context limit (`max_input_tokens`). `provider_count`: what the
    provider reports as `usage.prompt_tokens` (default: ctxgate's own count, tools included:
    an OpenAI-like provider). `upstream_s`: the upstream's reply time, slept only while a
    background compaction runs (nothing else happens in it), so the replay stays fast.
    `wait_background`: a background compaction ends before the next turn, as it would while
    the recorded agent ran its tools and waited for its reply; the replay is then the same
    on every run, however busy the machine (without it, how far a speculation got in
    `upstream_s` decides whether the next turn finds it ready)."""
    sessions = MemorySessionStore()
    content = MemoryContentStore()
    speculator = Speculator(in_memory_sessions(sessions), content=content) if speculate else None
    steps: list[dict[str, Any]] = []
    compactor = Compactor(on_step=steps.append, speculator=speculator, content=content)
    pipeline_config = config or PipelineConfig()
    out = Replay()

    async def counted_summary(prompt: list[Message]) -> str:
        out.summaries += 1
        return await summarize(prompt)

    try:
        for i in agent_turns(messages):
            request = messages[:i]
            turn = Turn(messages=request, fingerprints=fingerprints_of(request), tools=tools, counter=counter,
                        config=pipeline_config, max_input_tokens=budget, summarize=counted_summary,
                        prices=prices_of(pipeline_config, prices))
            steps.clear()
            started = time.perf_counter()
            async with sessions.lock(TENANT, SESSION):
                state = await sessions.load(TENANT, SESSION) or SessionState(TENANT, SESSION)
                turn.count_offset, turn.count_scale = state.count_offset, state.count_scale
                records_before = [(r.prefix_len, r.prefix_hash) for r in state.records]
                try:
                    plan = await compactor.prepare(state, turn)
                except GatewayError as e:
                    if e.code != "context_exhausted":
                        raise
                    await sessions.save(state)
                    done = Forwarded(i, [], [], False, 0, (time.perf_counter() - started) * 1000, False,
                                     tokens_in=turn.tokens_in(), refused=e.message, steps=list(steps))
                else:
                    new = [r for r in state.records if (r.prefix_len, r.prefix_hash) not in records_before]
                    state.has_attempted_reactive_compact = False  # the upstream answered
                    sent_messages = with_notice(plan.messages)  # as the gateway forwards them
                    sent = provider_count(sent_messages) if provider_count else plan.counted_tokens()
                    calibration = measured_calibration(turn, plan.counted_tokens(), sent)
                    if calibration is not None:
                        state.count_offset, state.count_scale = calibration
                    await sessions.save(state)
                    done = Forwarded(i, sent_messages, plan.levels, bool(new), sent,
                                     (time.perf_counter() - started) * 1000,
                                     any(h.startswith("speculative") for h in plan.hints), tokens_in=turn.tokens_in(),
                                     record=new[-1] if new else None, steps=list(steps), hints=list(plan.hints))
            out.turns.append(done)
            if on_turn is not None:
                on_turn(done)
            running = speculator is not None and speculator.running(TENANT, SESSION)
            await asyncio.sleep(upstream_s if running and upstream_s else 0.005)  # a background compaction gets to run
            while wait_background and speculator is not None and speculator.running(TENANT, SESSION):
                await asyncio.sleep(0.005)
    finally:
        if speculator is not None:
            await speculator.close()
    return out
