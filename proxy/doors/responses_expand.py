"""The expansion tool on the OpenAI Responses door: offered as a function tool, its
`function_call` items read from a whole or streamed response, answered as
`function_call_output` items, and taken out of what the agent receives, output indices
renumbered (docs/expansion.md)."""
from __future__ import annotations

from typing import Any

import orjson

from ..engine.expansion import AskedCalls, ToolCall
from .responses_model import convert
from .sse import event_data, with_data

_ITEM_EVENTS = ("response.output_item.added", "response.output_item.done", "response.function_call_arguments.delta",
                "response.function_call_arguments.done")
_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class ResponsesExpansion:
    """`ExpandingWire` for OpenAI Responses."""

    def with_tool(self, payload: dict[str, Any], tool: dict[str, Any]) -> dict[str, Any]:
        return {**payload, "tools": [*(payload.get("tools") or []), {"type": "function", **tool}]}

    def asked(self, body: bytes, tool_name: str) -> AskedCalls | None:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        output = data.get("output") if isinstance(data, dict) else None
        return _asked(output, tool_name) if isinstance(output, list) else None

    def follow_up(self, payload: dict[str, Any], asked: AskedCalls,
                  results: list[tuple[ToolCall, str]]) -> dict[str, Any]:
        items = payload.get("input")
        items = items if isinstance(items, list) else [{"role": "user", "content": items}]
        return {**payload, "input": [*items, *asked.assistant, *_answers(results)]}

    def exchange(self, asked: AskedCalls, results: list[tuple[ToolCall, str]]) -> list[dict[str, Any]]:
        return convert(None, [*asked.assistant, *_answers(results)]).messages

    def without_ours(self, body: bytes, tool_name: str) -> bytes:
        data = orjson.loads(body)
        data["output"] = [item for item in data.get("output") or [] if not _ours(item, tool_name)]
        return orjson.dumps(data)

    def stream_expansion(self, tool_name: str) -> "ResponsesStreamExpansion":
        return ResponsesStreamExpansion(tool_name)


class ResponsesStreamExpansion:
    """Responses events: each output item opens with `response.output_item.added` (a function
    call names its function there), its events carry its `output_index`, and the final event
    carries the whole response."""

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name
        self._ours: set[int] = set()

    def opening(self, event: bytes) -> bool | None:
        """Reasoning is held with the rest (a call after it needs it in the follow-up); the
        first message or function call decides."""
        data = event_data(event) or {}
        kind = data.get("type")
        if kind == "response.output_item.added":
            item = data.get("item") or {}
            return None if item.get("type") == "reasoning" else _ours(item, self.tool_name)
        if kind in _FINAL_EVENTS or kind == "error":
            return False
        return None

    def asked(self, events: list[bytes]) -> AskedCalls | None:
        for event in reversed(events):
            data = event_data(event) or {}
            if data.get("type") in _FINAL_EVENTS and isinstance(data.get("response"), dict):
                output = data["response"].get("output")
                return _asked(output, self.tool_name) if isinstance(output, list) else None
        return None

    def filter(self, event: bytes) -> bytes:
        data = event_data(event)
        kind = data.get("type") if data is not None else None
        if data is None or kind not in (*_ITEM_EVENTS, *_FINAL_EVENTS) and "output_index" not in data:
            return event
        if kind in _FINAL_EVENTS:
            response = data.get("response") or {}
            output = response.get("output")
            if not isinstance(output, list) or not any(_ours(item, self.tool_name) for item in output):
                return event
            response["output"] = [item for item in output if not _ours(item, self.tool_name)]
            return with_data(event, data)
        index = data.get("output_index")
        if not isinstance(index, int):
            return event
        if kind == "response.output_item.added" and _ours(data.get("item") or {}, self.tool_name):
            self._ours.add(index)
        if index in self._ours:
            return b""
        shift = sum(1 for i in self._ours if i < index)
        if not shift:
            return event
        data["output_index"] = index - shift  # the SDK puts each item at its index: no gaps
        return with_data(event, data)


def _asked(output: list[Any], tool_name: str) -> AskedCalls | None:
    items = [item for item in output if isinstance(item, dict)]
    ours = [item for item in items if _ours(item, tool_name)]
    if not ours:
        return None
    others = sum(1 for item in items if item.get("type") == "function_call") - len(ours)
    calls = [ToolCall(str(item.get("call_id")), str(item.get("arguments") or "")) for item in ours]
    return AskedCalls(calls, others, items)


def _ours(item: dict[str, Any], tool_name: str) -> bool:
    return item.get("type") == "function_call" and item.get("name") == tool_name


def _answers(results: list[tuple[ToolCall, str]]) -> list[dict[str, Any]]:
    return [{"type": "function_call_output", "call_id": call.call_id, "output": text} for call, text in results]
