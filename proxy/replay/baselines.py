"""What a client without ctxgate sends under a limit, turn by turn: the yardsticks ctxgate's
replays are scored against (bench/dialects.py).

Each keeps the leading system message(s) and the newest unit (an assistant message with its
tool calls' results, or any other single message) and never separates a tool call from its
results: *drop-oldest* drops the oldest units until the request fits, *middle-out* the unit
at the centre of the rest, again and again (as OpenRouter's middle-out transform does). The
upstream refuses what is still over the limit.
"""
from __future__ import annotations

from collections.abc import Callable

from ctxgate.pipeline.turns import leading_instructions
from .driver import Forwarded, Message, Replay, agent_turns
from .upstream import UPSTREAM, ProviderCount

BASELINES: dict[str, Callable[[int], int]] = {"drop-oldest": lambda n: 0, "middle-out": lambda n: (n - 1) // 2}
"""Each baseline's pick: the index of the unit it drops next, among n."""


def units_of(body: list[Message]) -> list[list[Message]]:
    units: list[list[Message]] = []
    for m in body:
        if m.get("role") == "tool" and units and units[-1][0].get("tool_calls"):
            units[-1].append(m)
        else:
            units.append([m])
    return units


def fit(request: list[Message], limit: int, provider: ProviderCount, pick: Callable[[int], int]) -> list[Message]:
    head = leading_instructions(request)
    units = units_of(request[head:])
    sizes = [sum(provider.counter.count_structured(m) for m in unit) for unit in units]
    total = provider(request)
    while total > limit and len(units) > 1:
        k = pick(len(units))
        total -= sizes.pop(k)
        units.pop(k)
    return request[:head] + [m for unit in units for m in unit]


def baseline_replay(messages: list[Message], limit: int, pick: Callable[[int], int],
                    provider: ProviderCount) -> Replay:
    out = Replay()
    for i in agent_turns(messages):
        sent = fit(messages[:i], limit, provider, pick)
        tokens = provider(sent)
        over = tokens > limit
        out.turns.append(Forwarded(i, sent, [], False, tokens, 0.0, False, refused="over the limit" if over else "",
                                   refused_by=UPSTREAM if over else ""))
    return out
