"""A recorded run replayed turn by turn against an upstream that enforces a context limit,
through ctxgate (as proxy/chat.py runs it) or through a trimming baseline. Used by
bench/dialects.py.

Every agent turn i (messages[i] is an assistant message, i >= 2) is the request
messages[:i], as the agent sent it. The upstream refuses a request whose count (ctxgate's
own o200k count of the messages plus the `tools` schema: an OpenAI-like provider) exceeds
the limit, and otherwise answers with the recorded reply, which is the next message of the
run. Nothing here calls an LLM: the summaries are scripted (see bench/dialects.py).

ctxgate, as the gateway does it (proxy/chat.py), in process, with no servers:
- the session locked, `Compactor.prepare` (speculative Autocompact on, like the gateway);
  a `context_exhausted` GatewayError there is a turn *refused by ctxgate before the upstream*;
- over the limit, the upstream refuses with OpenAI's context-length message; ctxgate calls
  `Compactor.reactive` once and sends again; if that raises `context_exhausted` or the
  retry is over the limit too (the gateway's next `reactive` would raise, the loop guard
  being set), the turn is *refused by the upstream*;
- an answered turn resets the loop guard and measures the count offset; a refused turn
  leaves the guard set, as the gateway does (only a complete reply resets it);
- after each turn, a background compaction (speculation) in flight is waited for: the
  recorded agent took seconds between turns, the scripted summary takes none.

Baselines (the leading system message(s) always kept, the newest unit always kept, a tool
call never separated from its results, so their requests stay valid):
- drop-oldest: drop the oldest units until the request fits;
- middle-out: drop the unit at the centre of the rest, again and again (so alternately
  either side of it, as OpenRouter's middle-out transform does), until the request fits.
A baseline request still over the limit with nothing left to drop is refused by the upstream.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import common  # noqa: F401  (sets up the tokenizer files and the import path)
from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.notes import with_notice
from ctxgate.pipeline.tokens import TokenCounter
from ctxgate.proxy.engine.compaction import Compactor, fingerprints_of
from ctxgate.proxy.engine.turn_budget import Turn, measured_calibration
from ctxgate.proxy.errors import GatewayError
from ctxgate.proxy.engine.speculative import Speculator
from ctxgate.proxy.engine.state import MemorySessionStore, SessionState
from common import in_memory_sessions
from turn_replay import agent_turns

Message = dict[str, Any]
TENANT, SESSION = "bench", "dialects"
CTXGATE, UPSTREAM = "ctxgate", "upstream"


@dataclass
class Sent:
    """One agent turn of one method."""
    turn: int
    """Index of the assistant message this request was sent for: the request is messages[:turn]."""
    messages: list[Message] | None
    """The last request that reached the upstream this turn; None when ctxgate refused it first."""
    tokens: int
    """`messages` in the provider's count (0 when None)."""
    refused: str = ""
    """"" (answered), CTXGATE (refused before the upstream) or UPSTREAM (over the limit)."""
    compacted: bool = False
    """ctxgate: a compaction point (the session's compaction records changed this turn)."""
    levels: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class MethodRun:
    sent: list[Sent] = field(default_factory=list)
    summaries: int = 0
    """Summary calls (Autocompact), speculative ones included."""
    summary_tokens: list[tuple[int, int]] = field(default_factory=list)
    """Each summary call's prompt and reply tokens."""


class ProviderCount:
    """The upstream's count of a request: ctxgate's count of the messages plus the tools schema."""

    def __init__(self, counter: TokenCounter, tools: list[dict[str, Any]] | None) -> None:
        self.counter = counter
        self.tools_tokens = counter.count_tools(tools)

    def __call__(self, messages: list[Message]) -> int:
        return self.counter.count_messages(messages) + self.tools_tokens


def too_long_message(limit: int, tokens: int) -> str:
    return (f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
            f"{tokens} tokens. Please reduce the length of the messages.")


def _records(state: SessionState) -> list[tuple[int, str]]:
    return [(r.prefix_len, r.prefix_hash) for r in state.records]


async def ctxgate_replay(messages: list[Message], tools: list[dict[str, Any]] | None, limit: int,
                         summary: Callable[[list[Message]], str], counter: TokenCounter,
                         config: PipelineConfig | None = None) -> MethodRun:
    """`summary(prompt)`: the text the summary model answers to Autocompact's prompt."""
    sessions = MemorySessionStore()
    speculator = Speculator(in_memory_sessions(sessions))
    compactor = Compactor(speculator=speculator)
    provider = ProviderCount(counter, tools)
    out = MethodRun()

    async def summarize(prompt: list[Message]) -> str:
        out.summaries += 1
        text = summary(prompt)
        out.summary_tokens.append((counter.count_messages(prompt), counter.count(text)))
        return text

    try:
        for i in agent_turns(messages):
            request = messages[:i]
            turn = Turn(messages=request, fingerprints=fingerprints_of(request), tools=tools, counter=counter,
                        config=config or PipelineConfig(), max_input_tokens=limit, summarize=summarize)
            sent = Sent(i, None, 0)
            async with sessions.lock(TENANT, SESSION):
                state = await sessions.load(TENANT, SESSION) or SessionState(TENANT, SESSION)
                turn.count_offset, turn.count_scale = state.count_offset, state.count_scale
                before = _records(state)
                try:
                    plan = await compactor.prepare(state, turn)
                except GatewayError as e:
                    if e.code != "context_exhausted":
                        raise
                    plan, sent.refused, sent.note = None, CTXGATE, e.message[:160]
                await sessions.save(state)
            if plan is not None:
                # As the gateway forwards it: with ctxgate's notice when quoted notes are in it.
                sent.messages = with_notice(plan.messages)
                sent.tokens, sent.levels = provider(sent.messages), list(plan.levels)
                if sent.tokens > limit:  # the upstream refuses: one reactive compaction, one retry
                    async with sessions.lock(TENANT, SESSION):
                        state = await sessions.load(TENANT, SESSION) or SessionState(TENANT, SESSION)
                        try:
                            plan, _ = await compactor.reactive(state, turn, plan, too_long_message(limit, sent.tokens),
                                                               False)
                            sent.messages = with_notice(plan.messages)
                            sent.tokens = provider(sent.messages)
                            sent.levels += [lv for lv in plan.levels if lv not in sent.levels]
                            if sent.tokens > limit:
                                sent.refused, sent.note = UPSTREAM, "over the limit after the reactive compaction"
                        except GatewayError as e:
                            if e.code != "context_exhausted":
                                raise
                            sent.refused, sent.note = UPSTREAM, e.message[:160]
                        await sessions.save(state)
                if not sent.refused:  # the recorded reply: the loop guard is reset, the count offset measured
                    async with sessions.lock(TENANT, SESSION):
                        state = await sessions.load(TENANT, SESSION) or SessionState(TENANT, SESSION)
                        state.has_attempted_reactive_compact = False
                        calibration = measured_calibration(turn, plan.tokens_out, sent.tokens)
                        if calibration is not None:
                            state.count_offset, state.count_scale = calibration
                        await sessions.save(state)
            state = await sessions.load(TENANT, SESSION) or SessionState(TENANT, SESSION)
            sent.compacted = _records(state) != before
            out.sent.append(sent)
            for _ in range(60_000):  # a speculation in flight finishes before the next turn (at most 60 s)
                if not speculator.running(TENANT, SESSION):
                    break
                await asyncio.sleep(0.001)
    finally:
        await speculator.close()
    return out


# ---------------------------------------------------------------------------------------
# Baselines (their own reading of the messages, independent of ctxgate's)


def units_of(body: list[Message]) -> list[list[Message]]:
    """An assistant message with its tool calls' results, or any other single message."""
    units: list[list[Message]] = []
    for m in body:
        if m.get("role") == "tool" and units and units[-1][0].get("tool_calls"):
            units[-1].append(m)
        else:
            units.append([m])
    return units


def _fit(request: list[Message], limit: int, provider: ProviderCount,
         pick: Callable[[list[list[Message]]], int]) -> list[Message]:
    """Keep the leading instructions and drop body units chosen by `pick` (never the last)
    until the request fits."""
    head = 0
    while head < len(request) and request[head].get("role") in ("system", "developer"):
        head += 1
    units = units_of(request[head:])
    sizes = [sum(provider.counter.count_structured(m) for m in unit) for unit in units]
    total = provider(request)
    while total > limit and len(units) > 1:
        k = pick(units)
        total -= sizes.pop(k)
        units.pop(k)
    return request[:head] + [m for unit in units for m in unit]


def drop_oldest(request: list[Message], limit: int, provider: ProviderCount) -> list[Message]:
    return _fit(request, limit, provider, lambda units: 0)


def middle_out(request: list[Message], limit: int, provider: ProviderCount) -> list[Message]:
    return _fit(request, limit, provider, lambda units: (len(units) - 1) // 2)


def baseline_replay(messages: list[Message], tools: list[dict[str, Any]] | None, limit: int,
                    method: Callable[[list[Message], int, ProviderCount], list[Message]],
                    counter: TokenCounter) -> MethodRun:
    provider = ProviderCount(counter, tools)
    out = MethodRun()
    for i in agent_turns(messages):
        forwarded = method(messages[:i], limit, provider)
        tokens = provider(forwarded)
        out.sent.append(Sent(i, forwarded, tokens, refused=UPSTREAM if tokens > limit else ""))
    return out
