"""Small builders shared by the tests/test_pipeline_*.py files (pure data, no servers)."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ctxgate.pipeline.tokens import TiktokenEncoder, TokenCounter, TokenizerRegistry
from ctxgate.pipeline.conversation import split_units
from ctxgate.pipeline.records import CompactionRecord
from ctxgate.pipeline.types import RecentWindow
from ctxgate.pipeline.turns import is_valid_sequence, leading_instructions, newest_user_index

Message = dict[str, Any]

LAST_UNIT = RecentWindow(messages=1, steps=0)
"""A recent window of just the turn in progress: tests of one level's mechanism use it, so
what they build is not all inside the default window of 10 messages."""
NO_WINDOW = RecentWindow(messages=0, steps=0)
"""No recent window at all: Microcompact's mechanism tests cut every output but the pinned ones."""


class CountingEncoder:
    """tiktoken, counting how many tokens it encoded: how many passes over a history a strategy makes."""

    inline_count_bytes = TiktokenEncoder.inline_count_bytes

    def __init__(self) -> None:
        self._enc = TiktokenEncoder("o200k_base")
        self.tokens = 0

    def encode(self, text: str) -> list[int]:
        ids = self._enc.encode(text)
        self.tokens += len(ids)
        return ids

    def count(self, text: str) -> int:
        n = self._enc.count(text)
        self.tokens += n
        return n

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


@lru_cache(maxsize=1)
def counter() -> TokenCounter:
    return TokenizerRegistry().for_model("gpt-4o")


def system(text: str = "You are a careful coding agent.") -> Message:
    return {"role": "system", "content": text}


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def call(call_id: str, name: str, **args: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def calls(*tool_calls: dict[str, Any], text: str = "") -> Message:
    return {"role": "assistant", "content": text, "tool_calls": list(tool_calls)}


def tool(call_id: str, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def bash_step(i: int, output: str) -> list[Message]:
    """Step `i` of a tool-calling agent on Chat Completions: `check i` run in bash, and its output."""
    return [{"role": "assistant", "content": None, "tool_calls": [call(f"call_{i}", "bash", command=f"check {i}")]},
            tool(f"call_{i}", output)]


def tool_use_step(i: int, output: str) -> list[Message]:
    """The same step on Anthropic Messages: a `tool_use` block, and its `tool_result`."""
    return [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "bash",
                                               "input": {"command": f"check {i}"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": output}]}]


def filler(tokens: int, seed: int = 0) -> str:
    """Text of exactly `tokens` tokens (o200k_base), distinct per seed."""
    words = " ".join(f"line{seed}x{i}" for i in range(tokens))
    encoder = TiktokenEncoder("o200k_base")  # the raw cut, not the counter's, which stops at a word
    return encoder.decode(encoder.encode(words)[:tokens]) if tokens > 0 else ""


def tool_turn(i: int, name: str = "execute_bash", size: int = 50, **args: Any) -> list[Message]:
    """An assistant tool call and its result: one unit of two messages."""
    cid = f"call_{i}"
    return [calls(call(cid, name, **(args or {"command": f"ls {i}"}))), tool(cid, filler(size, i))]


def agent_history(turns: int = 20, size: int = 50, name: str = "execute_bash") -> list[Message]:
    """system, task, `turns` tool units, a newest user message, and a final tool unit."""
    out = [system(), user("TASK: fix the failing test in src/app.py")]
    for i in range(turns):
        out += tool_turn(i, name, size)
    out.append(user("NEWEST: please also update the changelog"))
    out += tool_turn(turns, name, size)
    return out


def chat_history(n: int = 30, size: int = 30) -> list[Message]:
    """system, task, then `n` alternating plain assistant/user messages, ending in assistant."""
    out = [system(), user("TASK: plan the migration")]
    for i in range(n):
        out.append(assistant(filler(size, 1000 + i)) if i % 2 == 0 else user(f"reply {i}: " + filler(size, 2000 + i)))
    if out[-1]["role"] != "assistant":
        out.append(assistant("done"))
    return out


def snapshot(messages: list[Message]) -> list[Message]:
    return copy.deepcopy(messages)


def tool_pairs_complete(messages: list[Message]) -> bool:
    """Every tool call has a result and every result a call (over the whole list)."""
    call_ids = [tc["id"] for m in messages for tc in m.get("tool_calls") or []]
    result_ids = [m["tool_call_id"] for m in messages if m.get("role") == "tool"]
    return sorted(call_ids) == sorted(result_ids)


def assert_invariants(original: list[Message], result: list[Message]) -> None:
    """DESIGN.md's invariants every strategy keeps."""
    assert is_valid_sequence(result), "invalid sequence"
    assert tool_pairs_complete(result)
    k = leading_instructions(original)
    assert result[:k] == original[:k], "leading instructions changed"
    newest = newest_user_index(original)
    if newest is not None:
        assert original[newest] in result, "newest user message lost or changed"


def last_unit(messages: list[Message]) -> list[Message]:
    u = split_units(messages)[-1]
    return messages[u.start:u.end]


def requestable(messages: list[Message]) -> list[Message]:
    """A recorded history as a client would send it: tool results without a `tool_call_id`
    (some SWE-agent recordings) get the id of the call they answer, in order, and a final
    assistant tool call that was never answered (OpenHands' `finish`) is left out."""
    out: list[Message] = []
    waiting: list[str] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            waiting = [tc["id"] for tc in m["tool_calls"]]
        elif m.get("role") == "tool" and not m.get("tool_call_id") and waiting:
            m = {**m, "tool_call_id": waiting[0]}
        if m.get("role") == "tool" and m.get("tool_call_id") in waiting:
            waiting.remove(m["tool_call_id"])
        out.append(m)
    while out and not is_valid_sequence(out):
        out.pop()
    return out


def real_histories(min_messages: int = 0) -> list[tuple[str, list[Message]]]:
    from trajectories import all_trajectories
    out = []
    for t in all_trajectories():
        msgs = requestable(t.messages)
        if len(msgs) >= min_messages:
            out.append((t.name, msgs))
    return out


@dataclass
class Facts:
    """A session's earlier facts as the planner reads them (`planner.Facts`), in memory."""
    records: list[CompactionRecord] = field(default_factory=list)
    expanded: list[dict[str, Any]] = field(default_factory=list)
    collapse: dict[str, Any] = field(default_factory=dict)
    breaker: dict[str, Any] = field(default_factory=dict)
    learned_max_input_tokens: int | None = None
