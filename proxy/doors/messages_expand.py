"""The expansion tool on the Anthropic Messages door: offered as a tool, its `tool_use` blocks
read from a whole or streamed message, answered as `tool_result` blocks in a user turn, and
taken out of what the agent receives, content block indices renumbered (docs/expansion.md)."""
from __future__ import annotations

from typing import Any

import orjson

from ..engine.expansion import AskedCalls, ToolCall
from .sse import event_data, with_data



class MessagesExpansion:
    """`ExpandingWire` for Anthropic Messages."""

    def with_tool(self, payload: dict[str, Any], tool: dict[str, Any]) -> dict[str, Any]:
        offered = {"name": tool["name"], "description": tool["description"], "input_schema": tool["parameters"]}
        return {**payload, "tools": [*(payload.get("tools") or []), offered]}

    def asked(self, body: bytes, tool_name: str) -> AskedCalls | None:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        content = data.get("content") if isinstance(data, dict) else None
        return _asked(content, tool_name) if isinstance(content, list) else None

    def follow_up(self, payload: dict[str, Any], asked: AskedCalls,
                  results: list[tuple[ToolCall, str]]) -> dict[str, Any]:
        return {**payload, "messages": [*payload["messages"], *self.exchange(asked, results)]}

    def exchange(self, asked: AskedCalls, results: list[tuple[ToolCall, str]]) -> list[dict[str, Any]]:
        answers = [{"type": "tool_result", "tool_use_id": call.call_id, "content": text} for call, text in results]
        return [asked.assistant, {"role": "user", "content": answers}]

    def without_ours(self, body: bytes, tool_name: str) -> bytes:
        data = orjson.loads(body)
        data["content"] = [b for b in data.get("content") or [] if not _ours(b, tool_name)]
        if data.get("stop_reason") == "tool_use" and not any(b.get("type") == "tool_use" for b in data["content"]):
            data["stop_reason"] = "end_turn"
        return orjson.dumps(data)

    def stream_expansion(self, tool_name: str) -> "MessagesStreamExpansion":
        return MessagesStreamExpansion(tool_name)


class MessagesStreamExpansion:
    """Anthropic events: each content block opens with `content_block_start` (a tool_use block
    names its tool there), then deltas and a stop, all under the block's index."""

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name
        self._ours: set[int] = set()
        self._agents_calls = 0

    def opening(self, event: bytes) -> bool | None:
        """Thinking is held with the rest (a call after it needs it, signed, in the follow-up);
        the first text or tool_use block decides."""
        data = event_data(event) or {}
        kind = data.get("type")
        if kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") in ("thinking", "redacted_thinking"):
                return None
            return _ours(block, self.tool_name)
        return None if kind in ("message_start", "ping", "content_block_delta", "content_block_stop", None) else False

    def asked(self, events: list[bytes]) -> AskedCalls | None:
        blocks: dict[int, dict[str, Any]] = {}
        inputs: dict[int, str] = {}
        for event in events:
            data = event_data(event) or {}
            index = data.get("index")
            if data.get("type") == "content_block_start" and isinstance(index, int):
                blocks[index] = dict(data.get("content_block") or {})
            elif data.get("type") == "content_block_delta" and index in blocks:
                _apply(blocks[index], data.get("delta") or {}, inputs, index)
        for index, text in inputs.items():
            blocks[index]["input"] = orjson.loads(text or "{}")
        return _asked([blocks[i] for i in sorted(blocks)], self.tool_name)

    def filter(self, event: bytes) -> bytes:
        data = event_data(event)
        kind = data.get("type") if data is not None else None
        if data is None or kind not in ("content_block_start", "content_block_delta", "content_block_stop",
                                        "message_delta"):
            return event
        if kind == "message_delta":
            delta = data.get("delta") or {}
            if delta.get("stop_reason") == "tool_use" and self._ours and not self._agents_calls:
                delta["stop_reason"] = "end_turn"
                return with_data(event, data)
            return event
        index = data.get("index")
        if not isinstance(index, int):
            return event
        if kind == "content_block_start":
            block = data.get("content_block") or {}
            if _ours(block, self.tool_name):
                self._ours.add(index)
            elif block.get("type") == "tool_use":
                self._agents_calls += 1
        if index in self._ours:
            return b""
        shift = sum(1 for i in self._ours if i < index)
        if not shift:
            return event
        data["index"] = index - shift  # the SDK puts each block at its index: no gaps
        return with_data(event, data)


def _apply(block: dict[str, Any], delta: dict[str, Any], inputs: dict[int, str], index: int) -> None:
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + (delta.get("text") or "")
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + (delta.get("thinking") or "")
    elif kind == "signature_delta":
        block["signature"] = delta.get("signature") or ""
    elif kind == "input_json_delta":
        inputs[index] = inputs.get(index, "") + (delta.get("partial_json") or "")


def _asked(content: list[Any], tool_name: str) -> AskedCalls | None:
    blocks = [b for b in content if isinstance(b, dict)]
    ours = [b for b in blocks if _ours(b, tool_name)]
    if not ours:
        return None
    others = sum(1 for b in blocks if b.get("type") == "tool_use") - len(ours)
    calls = [ToolCall(str(b.get("id")), orjson.dumps(b.get("input") or {}).decode()) for b in ours]
    return AskedCalls(calls, others, {"role": "assistant", "content": blocks})


def _ours(block: dict[str, Any], tool_name: str) -> bool:
    return block.get("type") == "tool_use" and block.get("name") == tool_name
