"""A recorded session replayed turn by turn through the compactor, as the turn engine runs
it, with no servers and no network.

Each agent turn i (messages[i] is an assistant message, i >= 2) is the request
messages[:i], as the agent sent it. For each: the session locked, `Compactor.prepare`
(stored records, the chain over the trigger, the loop guard, speculative Autocompact),
the state saved. A `context_exhausted` refusal is kept as a turn refused by ctxgate; the
agent's next turn goes on, as a real agent would after the error.

With `enforce_limit`, the upstream counts the forwarded request as the provider does and
refuses one over the limit with OpenAI's context-length message; the session is locked
again and `Compactor.reactive` compacts once more, as the gateway's `forward` does, until
the request fits or ctxgate gives up (the loop guard, set by the first reactive compaction,
makes the next one raise `context_exhausted`): then the turn is refused by the upstream.

An answered turn gets the recorded reply: the loop guard is reset and the count offset
measured against the provider's count of what was forwarded. A refused turn leaves the
guard set, as the gateway does (only a complete reply resets it).
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.depth import prices_of
from ctxgate.pipeline.notes import with_notice
from ctxgate.pipeline.policy import Prices
from ctxgate.pipeline.tokens import TokenCounter
from ctxgate.wal.config import WalConfig
from ..engine.compaction import Compactor, Plan, fingerprints_of
from ..engine.content_store import MemoryContentStore
from ..engine.journal import Journal
from ..engine.session import Sessions
from ..engine.speculative import Speculator
from ..engine.summary_cost import SummaryCost
from ..engine.state import CompactionRecord, MemorySessionStore, SessionState
from ..engine.turn_budget import Summarize, Turn, measured_calibration
from ..errors import GatewayError
from .upstream import CTXGATE, UPSTREAM, too_long_message

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
    """Why the turn was refused: ctxgate's CONTEXT_EXHAUSTED message, or the upstream's."""
    refused_by: str = ""
    """`CTXGATE` (before the upstream) or `UPSTREAM` (over the limit: `messages` is what it refused)."""
    reactive: int = 0
    """Reactive compactions after the upstream's refusals this turn."""
    record: CompactionRecord | None = None
    """The record this turn's compaction made (`compacted` turns)."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """The compaction log entries of this turn: level, span, tokens before and after."""
    hints: list[str] = field(default_factory=list)


@dataclass
class Replay:
    turns: list[Forwarded] = field(default_factory=list)
    summaries: int = 0
    summary_tokens: list[tuple[int, int]] = field(default_factory=list)
    """Each summary call's prompt and reply, in the replay's count."""
    wasted: list[tuple[str, int, int]] = field(default_factory=list)
    """Summaries paid for whose note was never sent: (why, summaries, their tokens), as the
    gateway's metrics count them (`engine/summary_cost.Waste`)."""
    state: SessionState | None = None
    """The session as the replay left it (its records, collapse store, working state)."""

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
                 enforce_limit: bool = False, on_turn: Callable[[Forwarded], None] | None = None) -> Replay:
    """`budget`: the model's context limit (`max_input_tokens`). `provider_count`: what the
    provider reports as `usage.prompt_tokens` (default: ctxgate's own count, tools included:
    an OpenAI-like provider). `enforce_limit`: the upstream refuses a request over `budget`
    (in `provider_count`), and ctxgate compacts reactively and sends again (see the module
    doc). `upstream_s`: the upstream's reply time, slept only while a background compaction
    runs (nothing else happens in it), so the replay stays fast. `wait_background`: a
    background compaction ends before the next turn, as it would while the recorded agent
    ran its tools and waited for its reply; the replay is then the same on every run, however
    busy the machine (without it, how far a speculation got in `upstream_s` decides whether
    the next turn finds it ready)."""
    sessions = MemorySessionStore()
    content = MemoryContentStore()
    out = Replay()

    def wasted(why: str, calls: int, tokens: int) -> None:
        out.wasted.append((why, calls, tokens))

    speculator = Speculator(in_memory_sessions(sessions), content=content, on_waste=wasted) if speculate else None
    steps: list[dict[str, Any]] = []
    compactor = Compactor(on_step=steps.append, speculator=speculator, content=content, on_waste=wasted)
    pipeline_config = config or PipelineConfig()

    async def counted_summary(prompt: list[Message]) -> str:
        out.summaries += 1
        text = await summarize(prompt)
        out.summary_tokens.append((counter.count_messages(prompt), counter.count(text)))
        return text

    async def load() -> SessionState:
        return await sessions.load(TENANT, SESSION) or SessionState(TENANT, SESSION)

    def forward(done: Forwarded, plan: Plan) -> None:
        done.messages = with_notice(plan.messages)  # as the gateway forwards them
        done.tokens = provider_count(done.messages) if provider_count else plan.counted_tokens()

    def compacted(done: Forwarded, state: SessionState, before: list[tuple[int, str]]) -> None:
        """A compaction point: the session's records changed this turn."""
        new = [r for r in state.records if (r.prefix_len, r.prefix_hash) not in before]
        done.compacted, done.record = bool(new), new[-1] if new else None

    def answered(state: SessionState, turn: Turn, plan: Plan, sent: int) -> None:
        """The recorded reply: the loop guard reset, the count offset measured."""
        state.has_attempted_reactive_compact = False
        calibration = measured_calibration(turn, plan.counted_tokens(), sent)
        if calibration is not None:
            state.count_offset, state.count_scale = calibration

    try:
        for i in agent_turns(messages):
            request = messages[:i]
            turn = Turn(messages=request, fingerprints=fingerprints_of(request), tools=tools, counter=counter,
                        config=pipeline_config, max_input_tokens=budget, summarize=counted_summary,
                        prices=prices_of(pipeline_config, prices))
            steps.clear()
            started = time.perf_counter()
            done = Forwarded(i, [], [], False, 0, 0.0, False)
            async with sessions.lock(TENANT, SESSION):
                state = await load()
                turn.count_offset, turn.count_scale = state.count_offset, state.count_scale
                records_before = [(r.prefix_len, r.prefix_hash) for r in state.records]
                plan: Plan | None = None
                try:
                    plan = await compactor.prepare(state, turn)
                except GatewayError as e:
                    if e.code != "context_exhausted":
                        raise
                    done.refused, done.refused_by = e.message, CTXGATE
                if plan is not None:
                    done.speculative = any(h.startswith("speculative") for h in plan.hints)
                    done.levels, done.hints = list(plan.levels), list(plan.hints)
                    forward(done, plan)
                    if not enforce_limit or done.tokens <= budget:
                        answered(state, turn, plan, done.tokens)
                    compacted(done, state, records_before)
                await sessions.save(state)
            while plan is not None and enforce_limit and done.tokens > budget:
                async with sessions.lock(TENANT, SESSION):  # the upstream refused: compact once more
                    state = await load()
                    try:
                        plan, _ = await compactor.reactive(state, turn, plan, too_long_message(budget, done.tokens),
                                                           False)
                    except GatewayError as e:
                        if e.code != "context_exhausted":
                            raise
                        done.refused, done.refused_by = e.message, UPSTREAM
                    else:
                        done.reactive += 1
                        done.levels += [lv for lv in plan.levels if lv not in done.levels]
                        forward(done, plan)
                        if done.tokens <= budget:
                            answered(state, turn, plan, done.tokens)
                    compacted(done, state, records_before)
                    await sessions.save(state)
                if done.refused:
                    break
            done.tokens_in, done.steps = turn.tokens_in(), list(steps)
            done.prepare_ms = (time.perf_counter() - started) * 1000
            out.turns.append(done)
            if on_turn is not None:
                on_turn(done)
            running = speculator is not None and speculator.running(TENANT, SESSION)
            await asyncio.sleep(upstream_s if running and upstream_s else 0.005)  # a background compaction gets to run
            while wait_background and speculator is not None and speculator.running(TENANT, SESSION):
                await asyncio.sleep(0.005)
        out.state = await load()
        # The recording ends: a background summary still pending was never needed.
        pending = SummaryCost.from_dict(out.state.speculative.get("summary"))
        if pending.calls:
            wasted("unneeded", pending.calls, pending.tokens)
    finally:
        if speculator is not None:
            await speculator.close()
    return out
