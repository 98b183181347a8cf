"""A turn's client messages as WAL events: USER_INPUT and TOOL_RESULT (docs/wal.md).

Kept apart from `journal.py`, which decides when and how events are written: this only
reads a turn's messages (either API's tool results, whether their outputs failed, who
said it) and says what the log records of each.
"""
from __future__ import annotations

from typing import Any

import orjson

from ctxgate.pipeline.failures import exit_status_of, failure_line
from ctxgate.wal.events import EventType, content_hash
from .state import SessionState
from .turn_budget import Turn


def message_events(state: SessionState, turn: Turn, start: int, store_content: bool,
                   number: int | None = None) -> list[dict[str, Any]]:
    """USER_INPUT / TOOL_RESULT for each client message from `start` (`first_unlogged`) on;
    the session then counts them as logged. `number`: the turn's, when it is logged after
    later turns of the session were planned (`count_beside.py`); else the session's count,
    which is the turn's when it is logged in the transaction that planned it."""
    messages = turn.messages
    hashes = turn.prefix_hashes
    events = []
    for i in range(start, len(messages)):
        m = messages[i]
        role = m.get("role")
        base = {"turn": state.turns if number is None else number, "index": i, "prefix_hash": hashes[i]}
        results = _tool_result_blocks(m) if role == "user" else []
        # Anthropic's tool results travel in a user turn, one block per call
        for j, b in results:
            text = _text(b.get("content"))
            error = _failure(text, bool(b.get("is_error")))
            events.append(_tool_result(base, _tool_use_name(messages, i, b), b.get("tool_use_id"),
                                       turn.counter.count_cached(text), error))
        content = m.get("content")
        if results and isinstance(content, list):
            content = [b for b in content if not (isinstance(b, dict) and b.get("type") == "tool_result")]
        if role == "user" and (content or not results):  # the user's own words, also beside tool results
            event = {"type": EventType.USER_INPUT.value, **base, "content_hash": content_hash(content or "")}
            if state.users:  # whose words: what deleting a user's data finds the session by
                event["user"] = state.users[-1]
            if store_content:
                event["content"] = content
            events.append(event)
        if role == "tool":
            error = _failure(_text(m.get("content")), False)
            events.append(_tool_result(base, _tool_name(messages, i), m.get("tool_call_id"),
                                       turn.counter.count_structured(m, turn.fingerprints[i]), error))
    if messages:
        state.wal_logged, state.wal_logged_hash = len(messages), hashes[-1]
    return events


def first_unlogged(state: SessionState, turn: Turn) -> int:
    """The first of the turn's messages past what the log has seen."""
    start = state.wal_logged
    if start > len(turn.messages) or (start and turn.prefix_hashes[start - 1] != state.wal_logged_hash):
        return 0  # the client rewrote its history: log it again from the start
    return start


def compression(step: dict[str, Any]) -> dict[str, Any]:
    return {"type": EventType.COMPRESSION.value, "level": step["level"], "input_tokens": step.get("tokens_before"),
            "output_tokens": step.get("tokens_after"), "duration_ms": step.get("duration_ms"),
            "span": step.get("span"), "reason": step.get("reason")}


def _failure(text: str, reported_error: bool) -> str:
    # The conversation model's rule (what activeRestore restores as the last failure), so the
    # log and the prompt never disagree on whether a step failed.
    return failure_line(text, exit_status_of(text), reported_error)


def _tool_result(base: dict[str, Any], tool: str | None, call_id: Any, tokens: int,
                 error: str) -> dict[str, Any]:
    event = {"type": EventType.TOOL_RESULT.value, **base, "tool": tool, "call_id": call_id,
             "result_tokens": tokens, "success": not error, "duration_ms": None}
    if error:
        event["error"] = error
    return event


def _tool_name(messages: list[dict[str, Any]], i: int) -> str | None:
    call_id = messages[i].get("tool_call_id")
    for j in range(i - 1, -1, -1):
        m = messages[j]
        if m.get("role") == "assistant":
            for call in m.get("tool_calls") or []:
                if isinstance(call, dict) and call.get("id") == call_id:
                    return (call.get("function") or {}).get("name")
            return messages[i].get("name")
    return messages[i].get("name")


def _tool_result_blocks(message: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [(j, b) for j, b in enumerate(content) if isinstance(b, dict) and b.get("type") == "tool_result"]


def _tool_use_name(messages: list[dict[str, Any]], i: int, result: dict[str, Any]) -> str | None:
    """The tool a `tool_result` block answers, from the `tool_use` blocks of the turn before it."""
    previous = messages[i - 1].get("content") if i > 0 else None
    for block in previous if isinstance(previous, list) else []:
        if isinstance(block, dict) and block.get("type") == "tool_use" and block.get("id") == result.get("tool_use_id"):
            name = block.get("name")
            return name if isinstance(name, str) else None
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else orjson.dumps(content).decode()
