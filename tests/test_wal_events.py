"""A turn's tool results judged beside its count (`wal_events.judged`) give the WAL the lines
judging them with the events gives: the same failures, the same everything else."""
from __future__ import annotations

from typing import Any

from ctxgate.pipeline.budget import Turn
from ctxgate.pipeline.config import PipelineConfig
from ctxgate.pipeline.history_index import HistoryIndex
from ctxgate.pipeline.tokens import TokenizerRegistry
from ctxgate.proxy.engine.state import SessionState
from ctxgate.proxy.engine.wal_events import judged, message_events

COUNTER = TokenizerRegistry().counter("tiktoken:o200k_base")
FAILED = "Traceback (most recent call last):\n  File \"t.py\", line 3\nAssertionError: 2 != 3\n"


def conversation() -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "pytest"}'}}
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing test."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": FAILED},
        {"role": "assistant", "content": None, "tool_calls": [{**call, "id": "c2"}]},
        {"role": "tool", "tool_call_id": "c2", "content": "3 passed in 0.01s"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "u1", "name": "bash", "input": {"cmd": "ls"}},
                                          {"type": "tool_use", "id": "u2", "name": "bash", "input": {"cmd": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u1", "content": "calc.py"},
                                     {"type": "tool_result", "tool_use_id": "u2", "content": "ok",
                                      "is_error": True},
                                     {"type": "text", "text": "And keep the style."}]},
    ]


async def unused(messages: list[dict[str, Any]]) -> str:
    raise AssertionError("nothing is summarised here")


def events(failures: Any, start: int = 0) -> list[dict[str, Any]]:
    messages = conversation()
    index = HistoryIndex.build([], COUNTER).extend(messages, 0, COUNTER, count=False).counted(messages, COUNTER)
    turn = Turn(messages=messages, fingerprints=index.fingerprints, tools=None, counter=COUNTER,
                config=PipelineConfig(), max_input_tokens=128_000, summarize=unused, index=index)
    state = SessionState(tenant="t", session_id="s")
    return message_events(state, turn, start, False, failures)


def test_judged_beside_the_count_logs_what_judging_with_the_events_logs() -> None:
    plain = events(None)
    assert [e.get("error") is not None for e in plain if e["type"] == "TOOL_RESULT"] == [True, False, False, True]
    assert events(judged(conversation())) == plain
    assert events(judged(conversation()), 5) == events(None, 5)


def test_a_judgement_given_is_the_one_logged() -> None:
    """What `judged` says is what the line says (no second judgement of the same output)."""
    given = judged(conversation())
    given[(3, -1)] = ""
    given[(7, 1)] = "said so"
    results = [e for e in events(given) if e["type"] == "TOOL_RESULT"]
    assert [e["success"] for e in results] == [True, True, True, False]
    assert results[3]["error"] == "said so"
